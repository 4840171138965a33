//! A small blocking client of the event socket, behind `memtrack mark`,
//! `memtrack status` and `memtrack cleanup`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

/// The socket to talk to: `--socket`, else `MEMTRACK_SOCKET`.
pub fn socket_path(flag: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    match std::env::var_os("MEMTRACK_SOCKET").filter(|v| !v.is_empty()) {
        Some(p) => Ok(PathBuf::from(p)),
        None => bail!("no memtrack socket: pass --socket PATH or set MEMTRACK_SOCKET (memtrack run sets it for the job)"),
    }
}

/// A connection to a running daemon.
#[derive(Debug)]
pub struct Connection {
    path: PathBuf,
    reader: BufReader<UnixStream>,
}

impl Connection {
    /// Connects to the daemon at `path` — only if the process listening
    /// there is this user's, root's, or the uid `MEMTRACK_SOCKET_OWNER`
    /// names: a socket in a folder others may write to can be swapped for
    /// theirs, which would then read every mark and answer for the daemon.
    pub fn open(path: &Path, timeout: Duration) -> anyhow::Result<Connection> {
        let stream = UnixStream::connect(path)
            .with_context(|| format!("no memtrack daemon answers at {}", path.display()))?;
        let owner = crate::sys::peer_uid(&stream)
            .with_context(|| format!("cannot tell who listens at {}", path.display()))?;
        check_owner(
            path,
            owner,
            crate::sys::uid(),
            std::env::var("MEMTRACK_SOCKET_OWNER").ok(),
        )?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        Ok(Connection {
            path: path.to_path_buf(),
            reader: BufReader::new(stream),
        })
    }

    /// Sends one message without waiting for a reply.
    pub fn send(&mut self, message: &serde_json::Value) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(message)?;
        line.push(b'\n');
        self.reader
            .get_mut()
            .write_all(&line)
            .with_context(|| format!("cannot send to {}", self.path.display()))
    }

    /// Reads one reply line. A reply with `"ok": false` is an error.
    pub(crate) fn reply(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .with_context(|| format!("no reply from {}", self.path.display()))?;
        if n == 0 {
            bail!("{} closed the connection", self.path.display());
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).context("the daemon's reply is not JSON")?;
        if v["ok"] == false {
            bail!(
                "the daemon refused: {} ({})",
                v["message"].as_str().unwrap_or("?"),
                v["error"].as_str().unwrap_or("?")
            );
        }
        Ok(v)
    }

    /// Sends and waits for the reply.
    pub fn call(&mut self, message: &serde_json::Value) -> anyhow::Result<serde_json::Value> {
        self.send(message)?;
        self.reply()
    }
}

/// Refuses a daemon socket whose listener runs as a uid other than `me`,
/// root, or the one `allowed` (`MEMTRACK_SOCKET_OWNER`) names.
fn check_owner(path: &Path, owner: u32, me: u32, allowed: Option<String>) -> anyhow::Result<()> {
    let allowed = allowed.and_then(|v| v.trim().parse::<u32>().ok());
    if owner == me || owner == 0 || allowed == Some(owner) {
        return Ok(());
    }
    bail!(
        "the socket {} is served by uid {owner}, not by this user (uid {me}) or root: not used \
         (another user may have put it there; if that user runs your memtrack, set \
         MEMTRACK_SOCKET_OWNER={owner})",
        path.display()
    )
}

/// A `status` reply as a short readable report.
pub fn format_status(v: &serde_json::Value) -> String {
    use std::fmt::Write;
    let mb = |x: &serde_json::Value| x.as_f64().unwrap_or(0.0);
    let run = &v["run"];
    let cur = &v["current"];
    let peak = &v["peak_usage"];
    // Names are the job's: one line each, shown, never obeyed.
    let text = |x: &serde_json::Value| {
        crate::logging::terminal::escape(x.as_str().unwrap_or("?")).into_owned()
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "run {} ({}) on {}, GPU: {}",
        text(&run["name"]),
        text(&run["mode"]),
        text(&run["host"]),
        text(&run["gpu_backend"]),
    );
    let _ = writeln!(
        out,
        "now:  host {:.1} MiB (high-water {:.1}), GPU {:.1} MiB",
        // `cpu_rss_mb`: a daemon from before the name was made the
        // document's.
        mb(if cur["cpu_ram_used_mb"].is_null() {
            &cur["cpu_rss_mb"]
        } else {
            &cur["cpu_ram_used_mb"]
        }),
        mb(&cur["cpu_hwm_mb"]),
        mb(&cur["gpu_tree_mb"])
    );
    let _ = writeln!(
        out,
        "peak: host {:.1} MiB (high-water {:.1}), GPU {:.1} MiB (allocator peak {:.1})",
        mb(&peak["cpu_ram_used_mb"]),
        mb(&peak["cpu_ram_hwm_mb"]),
        mb(&peak["gpu_process_used_mb"]),
        mb(&peak["gpu_ram_peak_mb"])
    );
    let _ = writeln!(
        out,
        "{:>8} {:>10} {:>10} {:>10}  NAME",
        "PID", "RSS MiB", "PEAK MiB", "GPU MiB"
    );
    for p in v["processes"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{:>8} {:>10.1} {:>10.1} {:>10.1}  {}{}",
            p["pid"].as_u64().unwrap_or(0),
            mb(&p["rss_mb"]),
            mb(&p["peak_rss_mb"]),
            mb(&p["gpu_mb"]),
            text(&p["name"]),
            if p["root"] == true { " (root)" } else { "" },
        );
    }
    let list = |key: &str| -> String {
        v[key]
            .as_array()
            .map(|a| a.iter().map(text).collect::<Vec<_>>().join(", "))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "none".into())
    };
    let _ = writeln!(
        out,
        "open spans: {}; open stages: {}",
        list("open_spans"),
        list("open_stages")
    );
    if let Some(levels) = v["levels"].as_object().filter(|l| !l.is_empty()) {
        let l: Vec<String> = levels
            .iter()
            .map(|(k, v)| format!("{} {}", crate::logging::terminal::escape(k), text(v)))
            .collect();
        let _ = writeln!(out, "pressure: {}", l.join(", "));
    }
    out
}

/// A usage bar: `[#####.....]`.
fn bar(ratio: f64, width: usize) -> String {
    let filled = ((ratio.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("[{}{}]", "#".repeat(filled), ".".repeat(width - filled))
}

/// One frame of `memtrack watch`: bars for host RAM and each GPU, then the
/// status report (processes, peaks, spans, stages).
pub(crate) fn format_watch(v: &serde_json::Value, clock: &str) -> String {
    use std::fmt::Write;
    let num = |x: &serde_json::Value| x.as_f64().unwrap_or(0.0);
    let level = |resource: &str| {
        v["levels"][resource]
            .as_str()
            .unwrap_or("normal")
            .to_string()
    };
    let mut out = String::new();
    let _ = writeln!(out, "memtrack watch — {clock} (Ctrl-C to quit)");
    for g in v["gpus"].as_array().into_iter().flatten() {
        let total = num(&g["total_mb"]);
        let used = num(&g["used_mb"]);
        let ratio = if total > 0.0 { used / total } else { 0.0 };
        let idx = g["index"].as_u64().unwrap_or(0);
        let _ = writeln!(
            out,
            "GPU {idx} {:<22} {} {:5.1}% {:.1}/{:.1} GiB  ours {:.1} GiB  util {:.0}%  {:.0}°C  {}",
            crate::logging::terminal::escape(g["name"].as_str().unwrap_or("?")),
            bar(ratio, 24),
            ratio * 100.0,
            used / 1024.0,
            total / 1024.0,
            num(&g["tree_used_mb"]) / 1024.0,
            num(&g["utilization_pct"]),
            num(&g["temperature_c"]),
            level(&format!("gpu{idx}")),
        );
    }
    let per: Vec<String> = v["peaks_by_component"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(c, p)| {
                    format!(
                        "{} {:.0}/{:.0}",
                        crate::logging::terminal::escape(c),
                        num(&p["cpu_ram_used_mb"]),
                        num(&p["gpu_process_used_mb"]).max(num(&p["gpu_ram_peak_mb"]))
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    // Time to OOM: one line per resource climbing towards its limit.
    for f in v["forecasts"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "time to OOM: {}",
            crate::logging::terminal::escape(f["message"].as_str().unwrap_or("?"))
        );
    }
    out.push_str(&format_status(v));
    if !per.is_empty() {
        let _ = writeln!(out, "component peaks (host/GPU MiB): {}", per.join(", "));
    }
    out
}

/// `memtrack watch`: redraws a frame every `interval` until interrupted or
/// the daemon goes away (then the last frame stays on screen).
pub fn watch(
    path: &Path,
    interval: Duration,
    once: bool,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let mut conn = Connection::open(path, Duration::from_secs(5))?;
    loop {
        let reply = match conn.call(&serde_json::json!({"type": "status"})) {
            Ok(r) => r,
            Err(e) if !once => {
                writeln!(
                    out,
                    "\nmemtrack at {} is gone ({e:#}); last view above",
                    path.display()
                )?;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        let clock = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
        let frame = format_watch(&reply, &clock);
        // Process, component and stage names are the job's: shown, never
        // obeyed.
        let frame = crate::logging::terminal::escape_output(&frame);
        if once {
            out.write_all(frame.as_bytes())?;
            return Ok(());
        }
        // Home, draw, clear what the last frame left below.
        write!(out, "\x1b[H{}\x1b[J", frame.replace('\n', "\x1b[K\n"))?;
        out.flush()?;
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::format_status;

    #[test]
    fn the_host_figure_is_read_by_its_name_or_its_earlier_one() {
        let now = serde_json::json!({"current": {"cpu_ram_used_mb": 512.5, "cpu_rss_mb": 512.5}});
        assert!(format_status(&now).contains("now:  host 512.5 MiB"));
        // A daemon from before the rename.
        let before = serde_json::json!({"current": {"cpu_rss_mb": 300.0}});
        assert!(format_status(&before).contains("now:  host 300.0 MiB"));
    }
}
