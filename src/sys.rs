//! The few Linux calls the standard library does not wrap: becoming a child
//! subreaper, `wait4` with resource usage, sending signals, `sysconf`.
//!
//! This is the only module with `unsafe` code; each block is a single libc
//! call whose arguments are plain integers or pointers to locals.
#![allow(unsafe_code)]

use std::io;

/// Makes this process the reaper of orphaned descendants
/// (`PR_SET_CHILD_SUBREAPER`), so a worker whose parent dies stays in the
/// followed tree and its exit status reaches us.
pub(crate) fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes the child of `cmd` join a cgroup before it executes the program:
/// between `fork` and `exec` it writes `0` ("myself") to the cgroup's
/// `cgroup.procs`, open here as `procs`, so every page the job touches is
/// charged to that cgroup. A failed write fails the spawn with its error.
pub fn join_cgroup_before_exec(cmd: &mut std::process::Command, procs: std::fs::File) {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child and only calls write(2)
    // on a descriptor it owns; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let rc = libc::write(procs.as_raw_fd(), b"0".as_ptr().cast(), 1);
            if rc == 1 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        });
    }
}

/// What `wait4` reports for a reaped child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reaped {
    /// The raw wait status (`WIFSIGNALED`, `WEXITSTATUS`, …).
    pub(crate) status: i32,
    /// `ru_maxrss` in KiB: the child's own peak RSS, exact even for spikes
    /// shorter than any sampling interval.
    pub(crate) max_rss_kib: u64,
}

/// Waits for one specific child. `block = false` returns `Ok(None)` when
/// it has not exited yet. Never waits for "any child", so it cannot steal
/// the status of a process somebody else spawned.
pub(crate) fn wait_child(pid: u32, block: bool) -> io::Result<Option<Reaped>> {
    let mut status: libc::c_int = 0;
    // SAFETY: zeroed rusage is a valid value of a plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let flags = if block { 0 } else { libc::WNOHANG };
    loop {
        // SAFETY: pointers to locals that outlive the call.
        let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, flags, &mut usage) };
        if rc == 0 {
            return Ok(None);
        }
        if rc > 0 {
            return Ok(Some(Reaped {
                status,
                max_rss_kib: usage.ru_maxrss.max(0) as u64,
            }));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Sends `signal` to `pid`.
pub fn kill(pid: u32, signal: i32) -> io::Result<()> {
    // 0 and values that wrap to a negative pid_t name process groups (-1:
    // every process this user may signal), never one process.
    let pid = match libc::pid_t::try_from(pid) {
        Ok(p) if p > 0 => p,
        _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
    };
    // SAFETY: kill with integer arguments only.
    let rc = unsafe { libc::kill(pid, signal) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether a process with this PID exists (it may belong to another user).
pub(crate) fn pid_exists(pid: u32) -> bool {
    match kill(pid, 0) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::EPERM),
    }
}

/// The uid of the process at the other end of the connected Unix socket
/// `fd` (`SO_PEERCRED`: the credentials the peer had when it connected or
/// listened, which it cannot forge).
pub(crate) fn peer_uid(fd: &impl std::os::fd::AsRawFd) -> io::Result<u32> {
    // SAFETY: zeroed ucred is a valid value of a plain C struct.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into a local struct.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(cred.uid)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes per page, for `statm`.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf with a constant name.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as u64
    } else {
        4096
    }
}

/// Clock ticks per second, for `stat`'s `starttime`.
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf with a constant name.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 {
        v as u64
    } else {
        100
    }
}

/// This process's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// This process's real user id.
pub fn uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// A group's id from its name or number.
pub(crate) fn group_id(group: &str) -> Option<u32> {
    if let Ok(gid) = group.parse::<u32>() {
        return Some(gid);
    }
    let name = std::ffi::CString::new(group).ok()?;
    // SAFETY: zeroed group is a valid value of a plain C struct.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live local; getgrnam_r writes only
    // within `buf` (whose length it is given) and `grp`.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    (rc == 0 && !result.is_null()).then_some(grp.gr_gid)
}

/// Raises the soft limit of open files to the hard limit: every client
/// connection and followed process holds a descriptor.
pub(crate) fn raise_nofile_limit() {
    // SAFETY: zeroed rlimit is a valid value of a plain C struct.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < lim.rlim_max
    {
        lim.rlim_cur = lim.rlim_max.min(1 << 20);
        // SAFETY: a pointer to a local.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    }
}

/// CPU time the calling thread has used.
pub(crate) fn thread_cpu_time() -> std::time::Duration {
    // SAFETY: zeroed timespec is a valid value of a plain C struct.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a local.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// The soft limit of open files now.
pub(crate) fn nofile_limit() -> u64 {
    // SAFETY: zeroed rlimit is a valid value of a plain C struct.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: a pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}

/// Whether systemd passed this process a socket (`LISTEN_PID` was this
/// process and `LISTEN_FDS` at least 1), as [`take_socket_activation`] found.
static SOCKET_ACTIVATION: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// Reads and removes the `LISTEN_*` variables so the job and other children
/// do not inherit them. Call it first thing in `main`, while the process has
/// one thread: changing the environment races with any other thread reading
/// it (glibc's `getenv` is not safe against `unsetenv`). Later calls are
/// no-ops.
pub fn take_socket_activation() {
    SOCKET_ACTIVATION.get_or_init(|| {
        let pid = std::env::var("LISTEN_PID").ok();
        let count = std::env::var("LISTEN_FDS").ok();
        for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            std::env::remove_var(var);
        }
        let ours = pid.and_then(|p| p.parse::<u32>().ok()) == Some(std::process::id());
        let count = count.and_then(|c| c.parse::<i32>().ok()).unwrap_or(0);
        ours && count >= 1
    });
}

/// The listening Unix socket systemd passed (socket activation: fd 3 with
/// `LISTEN_PID` = this process, as [`take_socket_activation`] recorded), if
/// any and if it really is a listening stream socket.
pub(crate) fn systemd_listener() -> Option<std::os::unix::net::UnixListener> {
    use std::os::fd::FromRawFd;
    if SOCKET_ACTIVATION.get() != Some(&true) {
        return None;
    }
    const FD: libc::c_int = 3;
    let int_opt = |level, name| -> Option<libc::c_int> {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a local int.
        let rc = unsafe {
            libc::getsockopt(
                FD,
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(value)
    };
    let is_unix_stream_listener = int_opt(libc::SOL_SOCKET, libc::SO_DOMAIN) == Some(libc::AF_UNIX)
        && int_opt(libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_STREAM)
        && int_opt(libc::SOL_SOCKET, libc::SO_ACCEPTCONN) == Some(1);
    if !is_unix_stream_listener {
        return None;
    }
    // SAFETY: fcntl on a descriptor we just checked is an open socket.
    unsafe { libc::fcntl(FD, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: systemd handed us fd 3 to own; nothing else in this process
    // uses it, and it is a listening Unix stream socket (checked above).
    Some(unsafe { std::os::unix::net::UnixListener::from_raw_fd(FD) })
}

/// The name of a signal number, for messages (`SIGTERM`).
pub(crate) fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// Hands the allocator's free memory back to the kernel (glibc keeps what a
/// burst of allocations freed, per thread arena). Elsewhere a no-op.
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::zombie_processes)] // reaped by wait_child, not Child::wait
    fn wait_child_reports_code_and_signal() {
        let child = std::process::Command::new("sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let r = wait_child(child.id(), true).unwrap().unwrap();
        assert_eq!(
            crate::model::Exit::from_wait_status(r.status),
            crate::model::Exit::code(7)
        );

        let child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        assert_eq!(wait_child(child.id(), false).unwrap(), None);
        kill(child.id(), libc::SIGKILL).unwrap();
        let r = wait_child(child.id(), true).unwrap().unwrap();
        assert_eq!(crate::model::Exit::from_wait_status(r.status).code, 137);
        assert_eq!(
            crate::model::Exit::from_wait_status(r.status).signal,
            Some(9)
        );
    }

    #[test]
    fn groups() {
        assert_eq!(group_id("0"), Some(0));
        assert_eq!(group_id("root"), Some(0));
        assert_eq!(group_id("no-such-group-memtrack"), None);
    }

    #[test]
    fn sysconf_values_are_sane() {
        assert!(page_size() >= 4096);
        assert!(clock_ticks() >= 100);
        assert!(pid_exists(std::process::id()));
    }
}

/// The kernel's socket table, asked one socket at a time (`sock_diag`
/// netlink, as `ss` does): who owns the TCP socket at `local` connected to
/// `remote`. One exact lookup costs the same however many sockets the
/// machine has, where reading `/proc/net/tcp` costs a line per socket.
#[derive(Debug)]
pub struct SockDiag(std::os::fd::OwnedFd);

/// `SOCK_DIAG_BY_FAMILY`, the request and reply type.
const SOCK_DIAG_BY_FAMILY: u16 = 20;

impl SockDiag {
    pub fn open() -> io::Result<SockDiag> {
        use std::os::fd::FromRawFd;
        // SAFETY: socket with integer arguments only.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by socket() and is owned by nobody else.
        Ok(SockDiag(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    /// The uid owning the TCP socket whose local address is `local` and
    /// remote address is `remote` (both of one family); `Ok(None)` when the
    /// kernel knows no such socket.
    pub fn tcp_owner(
        &self,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
    ) -> io::Result<Option<u32>> {
        use std::net::IpAddr;
        use std::os::fd::AsRawFd;
        let octets = |ip: IpAddr| -> [u8; 16] {
            let mut b = [0u8; 16];
            match ip {
                IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
                IpAddr::V6(v6) => b = v6.octets(),
            }
            b
        };
        let family = match (local.ip(), remote.ip()) {
            (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
            (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
            _ => return Ok(None),
        };
        // nlmsghdr (16 bytes), then inet_diag_req_v2 (56 bytes).
        let mut req = [0u8; 72];
        req[0..4].copy_from_slice(&72u32.to_ne_bytes());
        req[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        req[8..12].copy_from_slice(&1u32.to_ne_bytes());
        req[16] = family as u8;
        req[17] = libc::IPPROTO_TCP as u8;
        req[20..24].copy_from_slice(&u32::MAX.to_ne_bytes()); // every state
        req[24..26].copy_from_slice(&local.port().to_be_bytes());
        req[26..28].copy_from_slice(&remote.port().to_be_bytes());
        req[28..44].copy_from_slice(&octets(local.ip()));
        req[44..60].copy_from_slice(&octets(remote.ip()));
        req[64..72].copy_from_slice(&[0xff; 8]); // no cookie
        let fd = self.0.as_raw_fd();
        // SAFETY: req is a live local buffer of the length passed.
        let sent = unsafe { libc::send(fd, req.as_ptr().cast(), req.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        // The kernel answers within send(): the reply is already queued.
        let mut reply = [0u8; 512];
        // SAFETY: reply is a live local buffer of the length passed.
        let got = unsafe {
            libc::recv(
                fd,
                reply.as_mut_ptr().cast(),
                reply.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        let reply = &reply[..got as usize];
        let u16_at = |i: usize| {
            reply
                .get(i..i + 2)
                .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        };
        let u32_at = |i: usize| {
            reply
                .get(i..i + 4)
                .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        };
        match u16_at(4) {
            Some(t) if t == libc::NLMSG_ERROR as u16 => {
                let errno = u32_at(16).map_or(0, |e| -(e as i32));
                if errno == libc::ENOENT {
                    Ok(None)
                } else {
                    Err(io::Error::from_raw_os_error(errno))
                }
            }
            Some(SOCK_DIAG_BY_FAMILY) => {
                // inet_diag_msg after the header: the state at 17, the
                // ports at 20 and 22, the owner at 80.
                let ports = reply.get(20..24);
                let mut want = [0u8; 4];
                want[..2].copy_from_slice(&local.port().to_be_bytes());
                want[2..].copy_from_slice(&remote.port().to_be_bytes());
                let listening = reply.get(17) == Some(&10);
                if ports != Some(&want[..]) || listening {
                    return Ok(None);
                }
                Ok(u32_at(80))
            }
            _ => Err(io::Error::other("unexpected sock_diag reply")),
        }
    }
}

/// Whether `fd` has input waiting now (a listening socket: a connection
/// waiting to be accepted). Never blocks.
pub(crate) fn has_input(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, timeout 0.
    let rc = unsafe { libc::poll(&mut p, 1, 0) };
    rc > 0 && p.revents & libc::POLLIN != 0
}
