// memtrack's report page: draws the run(s) embedded as JSON in
// #memtrack-data. Every string from the data goes on the page as text
// (textContent, createTextNode), never as markup.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("memtrack-data").textContent);
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#bf3989", "#0a8a8a", "#57606a",
    "#fb8500", "#6639ba", "#2da44e", "#e16f24"];
  const SERIES = {
    host: ["host (tree)", "--host"], hwm: ["between samples (high-water)", "--hwm"], charge: ["cgroup charge", "--charge"],
    gpu: ["GPU (NVML, tree)", "--gpu"], alloc: ["allocated (PyTorch)", "--alloc"], reserved: ["reserved (PyTorch)", "--reserved"],
  };
  const HOST_KEYS = ["host", "hwm", "charge"];
  const GPU_KEYS = ["gpu", "reserved", "alloc"];
  const M = 70, R = 16; // left and right margins of every chart

  // ---- small helpers ------------------------------------------------------
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) {
      if (k === "class") e.className = attrs[k]; else e.setAttribute(k, attrs[k]);
    }
    for (const c of kids) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
    return e;
  }
  function sv(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  function mib(v) {
    if (v === null || v === undefined || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1024) return (v / 1024).toFixed(2) + " GiB";
    if (a >= 100) return v.toFixed(0) + " MiB";
    return v.toFixed(1) + " MiB";
  }
  function secs(s) {
    if (!isFinite(s)) return "–";
    const a = Math.abs(s);
    if (a > 0 && a < 0.1) return (s * 1000).toFixed(a < 0.01 ? 2 : 1) + " ms";
    if (a < 60) return s.toFixed(a < 10 ? 2 : 1) + " s";
    if (a < 3600) return Math.floor(s / 60) + " min " + (s % 60).toFixed(0) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function section(id, title) {
    const s = el("section", { id: id }, el("h2", null, title));
    document.getElementById("main").append(s);
    return s;
  }
  function table(head, rows) {
    const t = el("table", null, el("thead", null, el("tr", null, ...head.map((h) => el("th", null, h)))));
    const b = el("tbody");
    for (const r of rows) b.append(el("tr", null, ...r.map((c, i) => el("td", i === 0 ? { class: "t" } : null, c))));
    t.append(b);
    return t;
  }
  function dl(pairs) {
    const d = el("dl");
    for (const [k, v] of pairs) if (v !== undefined && v !== null && v !== "") d.append(el("dt", null, k), el("dd", null, v));
    return d;
  }
  // Index of the last point (flat [t, v, ...]) at or before t, or -1.
  function at(flat, t) {
    let lo = 0, hi = flat.length / 2 - 1, ans = -1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (flat[2 * mid] <= t) { ans = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return ans;
  }
  function valueAt(flat, t) {
    const i = at(flat, t);
    return i < 0 ? null : flat[2 * i + 1];
  }
  function maxPoint(flat) {
    let best = -1;
    for (let i = 1; i < flat.length; i += 2) if (best < 0 || flat[i] > flat[best]) best = i;
    return best < 0 ? null : [flat[best - 1], flat[best]];
  }
  function niceStep(span, n) {
    const raw = span / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }

  // ---- the shared view: one x range for every chart ------------------------
  const view = { a: 0, b: 1, full: [0, 1], charts: [], cursor: null, xName: "time since start (s)", xFmt: secs };
  function setView(a, b) {
    const [fa, fb] = view.full, min = (fb - fa) * 1e-6 || 1e-6;
    if (b - a < min) { const m = (a + b) / 2; a = m - min / 2; b = m + min / 2; }
    view.a = Math.max(fa, a); view.b = Math.min(fb, b);
    if (view.b <= view.a) { view.a = fa; view.b = fb; }
    redraw();
  }
  function redraw() { for (const c of view.charts) c.draw(); }
  window.addEventListener("resize", redraw);

  // A chart: an SVG whose drawing function gets (svg, width, x-scale).
  function chart(parent, height, paint, hoverText, id) {
    const svg = sv("svg", { class: "chart", height: height, id: id });
    parent.append(svg);
    const c = { svg: svg, height: height, w: 0 };
    c.x = (t) => M + (t - view.a) / (view.b - view.a) * (c.w - M - R);
    c.t = (x) => view.a + (x - M) / (c.w - M - R) * (view.b - view.a);
    c.draw = function () {
      c.w = Math.max(320, svg.parentNode.clientWidth || 900);
      svg.setAttribute("width", c.w);
      svg.setAttribute("viewBox", "0 0 " + c.w + " " + height);
      while (svg.firstChild) svg.firstChild.remove();
      paint(svg, c);
      if (view.cursor !== null && view.cursor >= view.a && view.cursor <= view.b) {
        const x = c.x(view.cursor);
        svg.append(sv("line", { class: "cursor", x1: x, x2: x, y1: 0, y2: height }));
      }
    };
    interact(c, hoverText);
    view.charts.push(c);
    return c;
  }

  // Wheel zooms around the pointer; a drag selects a range to zoom into;
  // shift-drag pans; a double click shows everything.
  function interact(c, hoverText) {
    const svg = c.svg;
    let drag = null;
    const px = (ev) => ev.clientX - svg.getBoundingClientRect().left;
    svg.addEventListener("wheel", (ev) => {
      ev.preventDefault();
      const t = c.t(px(ev)), k = ev.deltaY > 0 ? 1.25 : 0.8;
      setView(t - (t - view.a) * k, t + (view.b - t) * k);
    }, { passive: false });
    svg.addEventListener("mousedown", (ev) => { drag = { x: px(ev), a: view.a, b: view.b, pan: ev.shiftKey }; });
    svg.addEventListener("mousemove", (ev) => {
      const x = px(ev);
      if (drag && drag.pan) {
        const dt = (x - drag.x) / (c.w - M - R) * (drag.b - drag.a);
        const [fa, fb] = view.full;
        let a = drag.a - dt, b = drag.b - dt;
        if (a < fa) { b += fa - a; a = fa; }
        if (b > fb) { a -= b - fb; b = fb; }
        setView(a, b);
      } else if (drag) {
        c.draw();
        const x0 = Math.min(drag.x, x), x1 = Math.max(drag.x, x);
        c.svg.append(sv("rect", { class: "sel", x: x0, y: 0, width: x1 - x0, height: c.height }));
      }
      hover(c, ev, hoverText);
    });
    window.addEventListener("mouseup", (ev) => {
      if (!drag) return;
      const d = drag; drag = null;
      const x = px(ev);
      if (!d.pan && Math.abs(x - d.x) > 4) {
        const t0 = c.t(Math.min(d.x, x)), t1 = c.t(Math.max(d.x, x));
        setView(t0, t1);
      } else c.draw();
    });
    svg.addEventListener("dblclick", () => setView(view.full[0], view.full[1]));
    svg.addEventListener("mouseleave", () => {
      view.cursor = null;
      document.getElementById("hover").style.display = "none";
      redraw();
    });
  }

  function hover(c, ev, hoverText) {
    const t = c.t(ev.clientX - c.svg.getBoundingClientRect().left);
    const box = document.getElementById("hover");
    if (t < view.a || t > view.b) { box.style.display = "none"; return; }
    view.cursor = t;
    redraw();
    box.textContent = hoverText(t);
    box.style.display = "block";
    const w = box.offsetWidth, h = box.offsetHeight;
    let left = ev.clientX + 14, top = ev.clientY + 14;
    if (left + w > window.innerWidth - 4) left = ev.clientX - w - 14;
    if (top + h > window.innerHeight - 4) top = ev.clientY - h - 14;
    box.style.left = Math.max(4, left) + "px";
    box.style.top = Math.max(4, top) + "px";
  }

  // Axes, grid and lines of one panel; returns the y scale.
  function panel(svg, c, title, lines, opts) {
    const top = 20, bottom = c.height - 22;
    let ymax = opts && opts.ymax ? opts.ymax : 0;
    const seen = [];
    for (const l of lines) {
      const pts = l.pts, n = pts.length / 2;
      let i0 = Math.max(0, at(pts, view.a)), i1 = Math.min(n - 1, at(pts, view.b) + 1);
      if (n === 0 || i1 < i0) { seen.push(null); continue; }
      seen.push([i0, i1]);
      for (let i = i0; i <= i1; i++) if (pts[2 * i + 1] > ymax) ymax = pts[2 * i + 1];
    }
    ymax = (ymax > 0 ? ymax : 1) * 1.08;
    const y = (v) => bottom - v / ymax * (bottom - top);
    svg.append(sv("text", { class: "title", x: M, y: 13 }, title));
    const step = ymax >= 2048 ? niceStep(ymax / 1024, 4) * 1024 : niceStep(ymax, 4);
    for (let v = 0; v <= ymax; v += step) {
      svg.append(sv("line", { class: "grid", x1: M, x2: c.w - R, y1: y(v), y2: y(v) }));
      svg.append(sv("text", { x: M - 6, y: y(v) + 4, "text-anchor": "end" }, mib(v)));
    }
    const xs = niceStep(view.b - view.a, Math.max(2, Math.floor((c.w - M - R) / 110)));
    for (let t = Math.ceil(view.a / xs) * xs; t <= view.b; t += xs) {
      svg.append(sv("line", { class: "grid", x1: c.x(t), x2: c.x(t), y1: top, y2: bottom }));
      svg.append(sv("text", { x: c.x(t), y: bottom + 14, "text-anchor": "middle" }, view.xFmt(t)));
    }
    svg.append(sv("line", { class: "axis", x1: M, x2: c.w - R, y1: bottom, y2: bottom }));
    const clipId = "clip" + Math.random().toString(36).slice(2);
    const clip = sv("clipPath", { id: clipId });
    clip.append(sv("rect", { x: M, y: 0, width: Math.max(0, c.w - M - R), height: c.height }));
    svg.append(clip);
    const g = sv("g", { "clip-path": "url(#" + clipId + ")" });
    lines.forEach((l, k) => {
      if (!seen[k]) return;
      const [i0, i1] = seen[k], parts = [];
      for (let i = i0; i <= i1; i++) parts.push(c.x(l.pts[2 * i]).toFixed(1) + "," + y(l.pts[2 * i + 1]).toFixed(1));
      if (parts.length === 1) {
        // One point (a process read once): a dot, a line has no length.
        const [x, yy] = parts[0].split(",");
        g.append(sv("circle", { cx: x, cy: yy, r: 3, fill: l.color }));
        parts.push(parts[0]);
      }
      g.append(sv("polyline", { points: parts.join(" "), fill: "none", stroke: l.color, "stroke-width": l.width || 1.5,
        "stroke-dasharray": l.dash || "none", "data-series": l.key || "" }));
    });
    svg.append(g);
    return y;
  }

  function legend(parent, lines) {
    const d = el("div", { class: "legend" });
    for (const l of lines) d.append(el("span", { style: "--c:" + l.color }, l.name));
    parent.append(d);
  }

  function cssColor(v) { return getComputedStyle(document.documentElement).getPropertyValue(v).trim() || "#333"; }

  // ---- one run -------------------------------------------------------------
  function runPage(run) {
    const rep = run.report || {}, info = rep.run || {}, peaks = rep.peak_usage || {};
    const top = document.getElementById("top");
    top.append(el("h1", { id: "run-name" }, run.label));
    const sub = [];
    if (info.host) sub.push(info.host);
    if (info.command && info.command.length) sub.push(info.command.join(" "));
    sub.push(secs(run.duration));
    if (info.exit) sub.push(info.exit.signal ? "killed by signal " + info.exit.signal : "exit " + info.exit.code);
    else if (info.status) sub.push(info.status);
    top.append(el("div", { class: "sub" }, sub.join("  ·  ")));

    const hostPeak = peaks.cpu_ram_used_mb || 0;
    const between = Math.max(hostPeak, peaks.cpu_ram_hwm_mb || 0);
    const gpuPeak = Math.max(peaks.gpu_process_used_mb || 0, peaks.reserved_gpu_ram_mb || 0, peaks.gpu_ram_used_mb || 0);
    const leak = rep.leak || {};
    const cards = el("div", { class: "cards" });
    const card = (k, v, attrs) => cards.append(el("div", { class: "card" }, el("div", { class: "k" }, k), el("div", Object.assign({ class: "v" }, attrs || {}), v)));
    card("peak host RAM (sampled)", mib(hostPeak), { id: "peak-host", "data-mib": String(hostPeak) });
    if (between > hostPeak) card("between samples", mib(between), { id: "peak-host-hwm", "data-mib": String(between) });
    if (gpuPeak > 0) card("peak GPU", mib(gpuPeak), { id: "peak-gpu", "data-mib": String(gpuPeak) });
    card("duration", secs(run.duration));
    card("processes", String(run.processes_total));
    card("leak", leak.suspected ? "suspected: " + (leak.suspects || []).join(", ") : (leak.host && leak.host.judged ? "none suspected" : "not judged"),
      { id: "leak-summary", class: "v " + (leak.suspected ? "bad" : "ok") });
    top.append(cards);

    adviceSection(rep.advice || []);
    timelineSection(run);
    peaksSection(rep, run);
    leakSection(leak);
    needsSection(rep.needs);
    processTable(rep.targets || [], run);
    alertsSection(rep.alerts || [], run);
    settingsSection(run);
  }

  function adviceSection(advice) {
    const s = section("advice", "Advice");
    if (!advice.length) { s.append(el("p", { class: "muted" }, "Nothing to change: no rule found anything in this run's figures.")); return; }
    const ul = el("ul", { class: "advice" });
    for (const a of advice) {
      const figs = Object.keys(a.figures || {}).map((k) => k + " = " + a.figures[k]).join(" · ");
      ul.append(el("li", { class: a.level, "data-code": a.code },
        el("div", null, el("span", { class: "lvl" }, a.level + " · " + a.code), a.finding),
        a.action ? el("div", { class: "action" }, "→ " + a.action) : null,
        figs ? el("div", { class: "figs" }, figs) : null));
    }
    s.append(ul);
  }

  function stagesOf(run) {
    return ((run.report || {}).stages || []).map((s) => ({ name: s.name, status: s.status,
      start: s.start - run.t0, end: (s.end === null || s.end === undefined ? run.t0 + run.duration : s.end) - run.t0, peak: s.peak }));
  }

  // What the page knows at time t of a run: marks, spans, stage, iteration.
  function context(run, t) {
    const out = [];
    const marks = run.marks || [];
    let lo = 0, hi = marks.length - 1, m = -1;
    while (lo <= hi) { const mid = (lo + hi) >> 1; if (marks[mid].t <= t) { m = mid; lo = mid + 1; } else hi = mid - 1; }
    let iteration = null;
    if (m >= 0) {
      const k = marks[m];
      out.push("mark: " + k.component + " / " + k.operation + " at " + secs(k.t) +
        (k.n > 1 ? " (last of " + k.n + " here)" : "") + (k.pid ? " · pid " + k.pid : ""));
      if (k.iteration !== undefined) iteration = k.iteration;
    }
    const it = run.iterations || [];
    const i = at(it, t);
    if (i >= 0 && (iteration === null || it[2 * i + 1] > iteration)) iteration = it[2 * i + 1];
    const spans = [];
    for (const lane of run.lanes || []) for (const b of lane.bars) if (b.start <= t && t <= b.end)
      spans.push(lane.component + " / " + b.operation + (b.n > 1 ? " (" + b.n + " spans)" : ""));
    if (spans.length) out.push("span: " + spans.join(", "));
    const stage = stagesOf(run).filter((s) => s.start <= t && t <= s.end).map((s) => s.name);
    if (stage.length) out.push("stage: " + stage.join(", "));
    if (iteration !== null) out.push("iteration: " + iteration);
    return out;
  }

  function timelineSection(run) {
    const s = section("timeline", "Timeline");
    view.full = [0, run.duration]; view.a = 0; view.b = run.duration;
    const bar = el("div", { class: "toolbar" });
    const reset = el("button", { id: "reset-zoom", type: "button" }, "show all");
    reset.addEventListener("click", () => setView(view.full[0], view.full[1]));
    bar.append(reset, "wheel: zoom · drag: zoom to a range · shift-drag: pan · double-click: show all");
    s.append(bar);
    const ser = run.series || {};
    const lines = (keys) => keys.filter((k) => ser[k]).map((k) => ({ key: k, name: SERIES[k][0], color: cssColor(SERIES[k][1]), pts: ser[k],
      dash: k === "hwm" ? "4 3" : null, width: k === "host" || k === "gpu" ? 2 : 1.2 }));
    const text = (keys, procLines) => (t) => {
      const rows = ["t = " + secs(t)];
      for (const k of keys) if (ser[k]) { const v = valueAt(ser[k], t); if (v !== null) rows.push(SERIES[k][0] + ": " + mib(v)); }
      // A process has a value only within its life.
      for (const l of procLines ? procLines() : []) {
        const v = valueAt(l.pts, t);
        if (v !== null && t <= l.pts[l.pts.length - 2]) rows.push(l.name + ": " + mib(v));
      }
      return rows.concat(context(run, t)).join("\n");
    };
    lanesChart(s, run, text(HOST_KEYS.concat(GPU_KEYS)));
    const host = lines(HOST_KEYS);
    const hostPeak = ser.host ? maxPoint(ser.host) : null;
    chart(s, 240, (svg, c) => {
      const y = panel(svg, c, "Host memory", host);
      if (hostPeak) peakMark(svg, c, y, hostPeak, "chart-host-peak");
    }, text(HOST_KEYS), "chart-host");
    legend(s, host);
    const gpu = lines(GPU_KEYS);
    if (gpu.length) {
      const key = ser.gpu ? "gpu" : ser.reserved ? "reserved" : "alloc";
      const gpuPeak = maxPoint(ser[key]);
      chart(s, 200, (svg, c) => {
        const y = panel(svg, c, "GPU memory", gpu);
        if (gpuPeak) peakMark(svg, c, y, gpuPeak, "chart-gpu-peak");
      }, text(GPU_KEYS), "chart-gpu");
      legend(s, gpu);
    }
    processesChart(s, run, text);
  }

  function peakMark(svg, c, y, p, id) {
    if (p[0] < view.a || p[0] > view.b) return;
    const g = sv("g", { id: id, "data-mib": String(p[1]), "data-t": String(p[0]) });
    g.append(sv("circle", { class: "peak", cx: c.x(p[0]), cy: y(p[1]), r: 4 }));
    const right = c.x(p[0]) > c.w - 160;
    g.append(sv("text", { class: "peaklabel", x: c.x(p[0]) + (right ? -8 : 8), y: Math.max(12, y(p[1]) - 6),
      "text-anchor": right ? "end" : "start" }, "peak " + mib(p[1]) + " at " + secs(p[0])));
    svg.append(g);
  }

  const STATUS = { SUCCESS: "#2da44e", FAILED: "#cf222e", RUNNING: "#0969da", ABANDONED: "#bf8700" };
  function lanesChart(s, run, hoverText) {
    const stages = stagesOf(run), lanes = run.lanes || [];
    const rowH = 18, rows = 1 + lanes.length, height = 20 + rows * rowH + 4;
    chart(s, height, (svg, c) => {
      svg.append(sv("text", { class: "title", x: M, y: 13 }, "Stages and spans"));
      const row = (i, name, cls, attrs) => {
        const g = sv("g", Object.assign({ class: cls }, attrs));
        const y0 = 20 + i * rowH;
        const label = sv("text", { class: "lanelabel", x: M - 6, y: y0 + 13, "text-anchor": "end" }, name.length > 11 ? name.slice(0, 10) + "…" : name);
        label.append(sv("title", {}, name));
        g.append(label);
        g.append(sv("line", { class: "grid", x1: M, x2: c.w - R, y1: y0 + rowH - 1, y2: y0 + rowH - 1 }));
        svg.append(g);
        return [g, y0];
      };
      const [sg, sy] = row(0, "stages", "lane stages", {});
      for (const st of stages) {
        if (st.end < view.a || st.start > view.b) continue;
        const x0 = Math.max(M, c.x(st.start)), x1 = Math.min(c.w - R, c.x(st.end));
        const r = sv("rect", { class: "bar", x: x0, y: sy + 2, width: Math.max(1, x1 - x0), height: rowH - 4,
          fill: STATUS[st.status] || "#8c959f", "fill-opacity": 0.55 });
        r.append(sv("title", {}, st.name + " · " + st.status));
        sg.append(r);
        if (x1 - x0 > 40) sg.append(sv("text", { x: x0 + 4, y: sy + 13, fill: "#1f2328" }, st.name + " · " + st.status));
      }
      lanes.forEach((lane, i) => {
        const [g, y0] = row(i + 1, lane.component, "lane", { "data-component": lane.component });
        const color = COLORS[i % COLORS.length];
        for (const b of lane.bars) {
          if (b.end < view.a || b.start > view.b) continue;
          const x0 = Math.max(M, c.x(b.start)), x1 = Math.min(c.w - R, c.x(b.end));
          const r = sv("rect", { class: "bar", x: x0, y: y0 + 3, width: Math.max(1, x1 - x0), height: rowH - 6, fill: color,
            "fill-opacity": b.open ? 0.3 : 0.6 });
          r.append(sv("title", {}, lane.component + " / " + b.operation + (b.n > 1 ? " (" + b.n + " spans)" : "")));
          g.append(r);
        }
      });
    }, hoverText, "chart-lanes");
  }

  function processesChart(s, run, text) {
    const procs = run.processes || [];
    if (!procs.length) return;
    const hasOwn = procs.some((p) => p.uss && p.uss.length);
    let mode = hasOwn ? "uss" : "rss";
    const bar = el("div", { class: "toolbar", id: "proc-mode" }, "Processes:");
    const modes = [["uss", "own cost (USS)"], ["pss", "proportional share (PSS)"], ["rss", "RSS"], ["gpu", "GPU"]];
    for (const [m, label] of modes) {
      if ((m === "uss" || m === "pss") && !hasOwn) continue;
      if (m === "gpu" && !procs.some((p) => p.gpu && p.gpu.length)) continue;
      const input = el("input", { type: "radio", name: "proc-mode", value: m, id: "proc-" + m });
      if (m === mode) input.checked = true;
      input.addEventListener("change", () => { mode = m; update(); });
      bar.append(el("label", null, input, " " + label));
    }
    if (run.processes_total > procs.length) bar.append("(the " + procs.length + " largest of " + run.processes_total + ")");
    s.append(bar);
    const lines = () => procs.map((p, i) => {
      let pts = p[mode] || [], name = p.pid + " " + p.name;
      if (!pts.length && (mode === "uss" || mode === "pss")) { pts = p.rss; name += " (RSS)"; }
      return { name: name, color: COLORS[i % COLORS.length], pts: pts };
    }).filter((l) => l.pts && l.pts.length);
    const holder = el("div");
    s.append(holder);
    const leg = el("div");
    const c = chart(holder, 220, (svg, c) => panel(svg, c, "Processes: " + modes.find((x) => x[0] === mode)[1], lines()), text([], lines), "chart-processes");
    s.append(leg);
    function update() { c.draw(); leg.textContent = ""; legend(leg, lines()); }
    update();
  }

  function peaksRow(name, p) {
    return [name, mib(p.cpu_ram_used_mb), mib(Math.max(p.cpu_ram_used_mb || 0, p.cpu_ram_hwm_mb || 0)),
      mib(Math.max(p.gpu_process_used_mb || 0, p.reserved_gpu_ram_mb || 0)), String(p.samples || 0)];
  }
  function peaksSection(rep, run) {
    const s = section("peaks", "Peaks by component and stage");
    const head = ["", "host RAM", "between samples", "GPU", "samples"];
    const comps = rep.peaks_by_component || {};
    const rows = Object.keys(comps).map((k) => peaksRow(k === "system" ? "system (outside spans)" : k, comps[k]));
    s.append(el("h3", null, "Components"), rows.length ? table(head, rows) : el("p", { class: "muted" }, "No components."));
    const st = stagesOf(run);
    const srows = st.map((x) => peaksRow(x.name, x.peak || {}).concat([x.status, secs(x.end - x.start)]));
    s.append(el("h3", null, "Stages"), srows.length ? table(head.concat(["status", "duration"]), srows) : el("p", { class: "muted" }, "No stages."));
  }

  function verdictText(v) {
    if (!v) return "no series";
    if (!v.judged) return v.reason && v.reason.startsWith("not judged") ? v.reason : "not judged: " + (v.reason || "too short");
    return (v.suspected ? "SUSPECTED: " : "no leak: ") + (v.rate_mib_per_hour >= 0 ? "+" : "") + mib(v.rate_mib_per_hour) + "/h over " +
      secs(v.window_s) + " (p = " + (v.p_value === undefined ? "?" : Number(v.p_value).toPrecision(2)) + ")" + (v.reason ? " — " + v.reason : "");
  }
  function leakSection(leak) {
    const s = section("leak", "Leak verdicts");
    const rows = [["host (tree)", verdictText(leak.host)]];
    if (leak.gpu) rows.push(["GPU (tree)", verdictText(leak.gpu)]);
    for (const t of leak.targets || []) {
      const who = "pid " + t.pid + " " + (t.name || "");
      rows.push([who + (t.figure ? " (" + t.figure.toUpperCase() + ")" : ""), verdictText(t.host)]);
      if (t.gpu) rows.push([who + " GPU", verdictText(t.gpu)]);
    }
    const comps = leak.components || {};
    for (const k of Object.keys(comps)) rows.push(["component " + k, verdictText(comps[k])]);
    if (leak.targets_not_judged) rows.push(["other processes", leak.targets_not_judged + " too short to judge"]);
    const t = table(["series", "verdict"], rows);
    t.querySelectorAll("td:nth-child(2)").forEach((td) => { td.className = "t " + (td.textContent.startsWith("SUSPECTED") ? "bad" : ""); });
    s.append(t);
  }

  function needsSection(n) {
    const s = section("needs", "What a re-run needs");
    if (!n) return;
    const gpus = Object.keys(n.gpu_peak_mb || {}).map((k) => "GPU " + k + ": " + mib(n.gpu_peak_mb[k]));
    s.append(dl([
      ["host RAM", mib(n.host_peak_mb) + " peak → " + mib(n.host_needed_mb) + " with 10 % headroom"],
      ["GPU", gpus.length ? gpus.join(", ") + " → " + mib(n.gpu_needed_mb) + " with 10 % headroom" : "none used"],
      ["GPU class that fits", n.gpu_class_gib ? n.gpu_class_gib + " GiB" : "–"],
    ]));
  }

  function processTable(targets, run) {
    const s = section("processes", "Processes");
    const own = {};
    for (const p of run.processes || []) own[p.pid] = p;
    const peakOwn = (p) => p && p.peak_uss_mb !== undefined ? (p.peak_uss_estimated ? "~" : "") + mib(p.peak_uss_mb) : "–";
    const rows = targets.map((t) => [t.pid + " " + t.name + (t.root ? " (root)" : ""), mib(t.peak_rss_mb),
      peakOwn(own[t.pid]), mib(t.hwm_mb), mib(t.peak_gpu_mb),
      t.exit ? (t.exit.signal ? "signal " + t.exit.signal : String(t.exit.code)) : "–"]);
    s.append(rows.length ? table(["process", "peak RSS", "peak own (USS)", "VmHWM", "peak GPU", "exit"], rows) : el("p", { class: "muted" }, "No processes recorded."));
    if (targets.some((t) => own[t.pid] && own[t.pid].peak_uss_estimated)) {
      s.append(el("p", { class: "muted", id: "own-estimated" }, "~ estimated: no own-cost read came while it held its size (its last read plus what it wrote since)."));
    }
  }

  function alertsSection(alerts, run) {
    if (!alerts.length) return;
    const s = section("alerts", "Pressure alerts");
    s.append(table(["time", "resource", "level", "used"], alerts.map((a) => [secs(a.timestamp - run.t0), a.resource, a.previous + " → " + a.level,
      (100 * a.used_ratio).toFixed(0) + " %"])));
  }

  function settingsSection(run) {
    const s = section("settings", "Settings and sources");
    const rep = run.report || {}, info = rep.run || {}, host = rep.host || {}, attr = rep.gpu_attribution;
    const labels = Object.keys(info.labels || {}).map((k) => k + "=" + info.labels[k]).join(", ");
    const backend = typeof info.gpu_backend === "string" ? info.gpu_backend : JSON.stringify(info.gpu_backend || "");
    s.append(dl([
      ["run id", info.id], ["mode", info.mode], ["command", (info.command || []).join(" ")], ["host", info.host],
      ["sampling interval", info.interval_s ? secs(info.interval_s) : ""],
      ["host figure", host.source ? host.source + (host.reason ? " — " + host.reason : "") : "sum of RSS (older file)"],
      ["GPU figures", backend],
      ["GPU attribution", attr ? JSON.stringify(attr) : ""],
      ["memory limit", info.memory_limit_mb ? mib(info.memory_limit_mb) : ""],
      ["host memory", info.host_memory_mb ? mib(info.host_memory_mb) : ""],
      ["labels", labels], ["status", info.status], ["memtrack", info.memtrack_version],
      ["log entries read", String(run.entries) + " (" + run.marks_total + " marks); drawn as columns of " + secs(run.column_s) +
        " keeping each column's lowest and highest point"],
      ["page written by", "memtrack " + D.memtrack_version],
    ]));
    const counters = run.counters || {};
    const nonzero = Object.keys(counters).filter((k) => counters[k]).map((k) => [k, String(counters[k])]);
    if (nonzero.length) s.append(el("h3", null, "Counters"), dl(nonzero));
  }

  // ---- runs overlaid -------------------------------------------------------
  function comparePage(runs) {
    const top = document.getElementById("top");
    top.append(el("h1", { id: "run-name" }, "Comparison of " + runs.length + " runs"));
    top.append(el("div", { class: "sub" }, runs.map((r) => r.label).join("  ·  ")));
    const s = section("overlay", "Memory, runs overlaid");
    const bar = el("div", { class: "toolbar" }, "align by ");
    const sel = el("select", { id: "align" });
    for (const [v, t] of [["time", "time since start"], ["iteration", "iteration"], ["stage", "stage"]]) sel.append(el("option", { value: v }, t));
    bar.append(sel, el("button", { type: "button", id: "reset-zoom" }, "show all"),
      "wheel: zoom · drag: zoom to a range · shift-drag: pan · double-click: show all");
    s.append(bar);
    const stageNames = [];
    for (const r of runs) for (const st of stagesOf(r)) if (!stageNames.includes(st.name)) stageNames.push(st.name);
    // t -> x for each alignment (NaN: not on this axis).
    const mappers = {
      time: () => (t) => t,
      iteration: (r) => {
        const it = r.iterations || [];
        return (t) => {
          const i = at(it, t);
          if (i < 0) return NaN;
          if (2 * i + 2 >= it.length) return it[2 * i + 1];
          const [t0, i0, t1, i1] = [it[2 * i], it[2 * i + 1], it[2 * i + 2], it[2 * i + 3]];
          return t1 > t0 ? i0 + (i1 - i0) * (t - t0) / (t1 - t0) : i0;
        };
      },
      stage: (r) => {
        const st = stagesOf(r);
        return (t) => {
          for (const x of st) if (x.start <= t && t <= x.end) return stageNames.indexOf(x.name) + (x.end > x.start ? (t - x.start) / (x.end - x.start) : 0);
          return NaN;
        };
      },
    };
    const mapped = (pts, f) => { const out = []; for (let i = 0; i < pts.length; i += 2) { const x = f(pts[i]); if (isFinite(x)) out.push(x, pts[i + 1]); } return out; };
    let hostLines = [], gpuLines = [];
    function build() {
      const mode = sel.value;
      view.xName = mode;
      view.xFmt = mode === "time" ? secs : mode === "iteration" ? (x) => "it " + Math.round(x) : (x) => {
        const k = Math.floor(x); return k >= 0 && k < stageNames.length && Math.abs(x - k) < 1e-9 ? stageNames[k] : (stageNames[k] || "") + (x - k > 0 ? " +" + (100 * (x - k)).toFixed(0) + "%" : "");
      };
      hostLines = []; gpuLines = [];
      let lo = Infinity, hi = -Infinity;
      runs.forEach((r, i) => {
        const f = mappers[mode](r), ser = r.series || {};
        const h = ser.host ? mapped(ser.host, f) : [];
        const gk = ser.gpu ? "gpu" : ser.reserved ? "reserved" : ser.alloc ? "alloc" : null;
        const g = gk ? mapped(ser[gk], f) : [];
        for (const pts of [h, g]) for (let k = 0; k < pts.length; k += 2) { lo = Math.min(lo, pts[k]); hi = Math.max(hi, pts[k]); }
        hostLines.push({ name: r.label, color: COLORS[i % COLORS.length], pts: h, run: r, f: f });
        if (g.length) gpuLines.push({ name: r.label + " (" + gk + ")", color: COLORS[i % COLORS.length], pts: g, run: r, f: f });
      });
      if (!isFinite(lo)) { lo = 0; hi = 1; }
      if (hi <= lo) hi = lo + 1;
      view.full = [lo, hi]; view.a = lo; view.b = hi;
      legendBox.textContent = ""; legend(legendBox, hostLines);
      redraw();
    }
    const text = (which) => (x) => {
      const rows = [view.xName + ": " + view.xFmt(x)];
      for (const l of which()) { const v = valueAt(l.pts, x); rows.push(l.name + ": " + (v === null ? "–" : mib(v))); }
      return rows.join("\n");
    };
    chart(s, 260, (svg, c) => panel(svg, c, "Host memory", hostLines), text(() => hostLines), "chart-host");
    const legendBox = el("div");
    s.append(legendBox);
    if (runs.some((r) => r.series && (r.series.gpu || r.series.reserved || r.series.alloc)))
      chart(s, 220, (svg, c) => panel(svg, c, "GPU memory", gpuLines), text(() => gpuLines), "chart-gpu");
    sel.addEventListener("change", build);
    document.getElementById("reset-zoom").addEventListener("click", () => setView(view.full[0], view.full[1]));
    const t = section("runs", "Peaks by run");
    t.append(table(["run", "host RAM", "between samples", "GPU", "duration", "exit"], runs.map((r) => {
      const p = (r.report || {}).peak_usage || {}, info = (r.report || {}).run || {};
      return [r.label, mib(p.cpu_ram_used_mb), mib(Math.max(p.cpu_ram_used_mb || 0, p.cpu_ram_hwm_mb || 0)),
        mib(Math.max(p.gpu_process_used_mb || 0, p.reserved_gpu_ram_mb || 0)), secs(r.duration),
        info.exit ? String(info.exit.code) : (info.status || "–")];
    })));
    for (const r of runs) {
      const a = r.report && r.report.advice;
      if (a && a.length) { t.append(el("h3", null, "Advice for " + r.label)); const ul = el("ul", { class: "advice" });
        for (const x of a) ul.append(el("li", { class: x.level }, x.finding + (x.action ? " → " + x.action : ""))); t.append(ul); }
    }
    build();
  }

  if (D.kind === "compare") comparePage(D.runs);
  else if (D.runs.length) runPage(D.runs[0]);
  redraw();
  document.body.setAttribute("data-ready", "1");
  window.memtrackReady = performance.now();
})();
