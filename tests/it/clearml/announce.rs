//! A job naming its own task over the socket: another task, a malformed
//! name or a flood of them changes nothing and costs little.

use std::time::Duration;

use super::{agent_run, Server};
use crate::common::*;

#[test]
fn announcements_of_other_tasks_and_malformed_ones_change_nothing() {
    let server = Server::start();
    // A task the job "made" (as the SDK would), already running.
    let id = server.task("job task", "memtrack-it", "in_progress");
    let out = scratch();
    let script = format!(
        "import os, socket, json\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rw')\n\
         def ask(obj):\n\
         \x20   f.write(json.dumps(obj) + '\\n'); f.flush(); return json.loads(f.readline())\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True, 'id': 1}})\n\
         assert r['ok'] and r['clearml'] and r['reporting'], r\n\
         for i in range(300):\n\
         \x20   r = ask({{'type': 'clearml_task', 'task': 'other%d' % i, 'ack': True, 'id': i}})\n\
         \x20   assert r['ok'] and not r['reporting'] and {id:?} in r['message'], r\n\
         for bad in ['', 'a b', '../x', 'x' * 65, 7, None]:\n\
         \x20   r = ask({{'type': 'clearml_task', 'task': bad, 'ack': True}})\n\
         \x20   assert not r['ok'] and r['error'] == 'invalid', r\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         for i in range(3):\n\
         \x20   ask({{'type': 'mark', 'component': 'model', 'operation': 'step', 'iteration': i, 'ack': True}})\n"
    );
    let res =
        agent_run(&server, out.path()).run(["python3", "-c", &script], Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let state = server.state();
    assert_eq!(state["tasks"].as_object().unwrap().len(), 1, "{state:#}");
    assert_eq!(
        state["tasks"][&id]["status"], "in_progress",
        "its status stays"
    );
    assert!(
        state["status_log"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["by"] != "memtrack"),
        "{state:#}"
    );
    let steps: std::collections::BTreeSet<u64> = server
        .points(&id)
        .iter()
        .filter(|p| p["metric"] == "memory/model")
        .map(|p| p["iter"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (0..3).collect());
    let noted = log.matches("is left alone").count();
    assert!(
        (1..=5).contains(&noted),
        "rate-limited log: {noted} lines\n{log}"
    );
    server.assert_exactly_once();
}

/// What once broke: two million fire-and-forget announcements of other
/// tasks wrote 20,000 WARN lines (one per hundred) and grew memtrack to
/// 60.7 MiB (an unbounded queue).
#[test]
fn a_flood_of_announcements_costs_a_few_lines_and_bounded_memory() {
    let server = Server::start();
    let id = server.task("job task", "memtrack-it", "in_progress");
    let out = scratch();
    let figures = out.path().join("rss");
    let script = format!(
        "import os, socket, json\n\
         s = socket.socket(socket.AF_UNIX); s.connect(os.environ['MEMTRACK_SOCKET'])\n\
         f = s.makefile('rwb')\n\
         def ask(obj):\n\
         \x20   f.write((json.dumps(obj) + '\\n').encode()); f.flush(); return json.loads(f.readline())\n\
         def kib(key):\n\
         \x20   for l in open('/proc/%d/status' % os.getppid()):\n\
         \x20       if l.startswith(key): return int(l.split()[1])\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         before = kib('VmHWM:')\n\
         burst = b''.join(b'{{\"type\":\"clearml_task\",\"task\":\"other%d\"}}\\n' % i for i in range(10000))\n\
         for _ in range(100):\n\
         \x20   f.write(burst)\n\
         f.flush()\n\
         r = ask({{'type': 'clearml_task', 'task': {id:?}, 'ack': True}})\n\
         assert r['reporting'], r\n\
         open({figures:?}, 'w').write('%d %d' % (before, kib('VmHWM:')))\n",
        figures = figures.display().to_string()
    );
    let res =
        agent_run(&server, out.path()).run(["python3", "-c", &script], Duration::from_secs(120));
    let log = stderr(&res);
    assert_eq!(res.status.code(), Some(0), "{log}");
    let noted = log.matches("is left alone").count();
    assert!(
        (1..=6).contains(&noted),
        "a million announcements: {noted} lines, {} bytes of log",
        log.len()
    );
    let text = std::fs::read_to_string(&figures).unwrap();
    let kib: Vec<u64> = text.split(' ').map(|v| v.parse().unwrap()).collect();
    let grew_mib = kib[1].saturating_sub(kib[0]) as f64 / 1024.0;
    eprintln!(
        "{noted} warning lines; memtrack's peak RSS before the flood {} KiB, after {} KiB",
        kib[0], kib[1]
    );
    // At most 64 announcements wait for the reporter: the flood costs
    // parsing buffers, not a queue of a million.
    assert!(
        grew_mib < 16.0,
        "memtrack grew {grew_mib:.1} MiB during the flood"
    );
}
