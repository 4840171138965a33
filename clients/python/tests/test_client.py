"""Unit tests of the client against fake daemons (no memtrack binary needed)."""

import asyncio
import os
import socket
import sys
import threading
import time
import types
import warnings

import pytest

import memtrack
from memtrack import client as client_mod


def test_fire_and_forget_marks_are_lines(fake):
    d = fake()
    c = memtrack.Client(d.path)
    for i in range(100):
        assert c.mark("model", "step", iteration=i, labels={"batch_size": 128, "name": "x"}) is None
    assert d.wait_lines(100)
    objs = d.objects()
    assert [o["iteration"] for o in objs] == list(range(100))
    assert all(o["type"] == "mark" and o["component"] == "model" and o["operation"] == "step" for o in objs)
    assert objs[0]["labels"] == {"batch_size": "128", "name": "x"}  # values become strings
    assert all("ack" not in o and "id" not in o for o in objs)
    assert {o["_pid"] for o in objs} == {os.getpid()}
    assert len({o["_conn"] for o in objs}) == 1  # one persistent connection
    assert c.dropped() == 0 and not d.garbled


def test_fast_steps_are_held_back_and_sent_together_with_their_times(fake, monkeypatch):
    # The framework hooks' steps: held back (here until 64 wait, whatever
    # the machine's pace), then sent in one write, each step as one
    # span_end line saying when it began and ended; any other message
    # sends the held ones first.
    from memtrack import frameworks

    d = fake()
    monkeypatch.setenv("MEMTRACK_SOCKET", d.path)
    monkeypatch.setattr(client_mod, "_default", None)
    monkeypatch.setattr(client_mod, "_HOLD_NS", 3600 * 10**9)
    monkeypatch.setattr(client_mod, "_HOLD_MAX", 64)
    monkeypatch.setattr(frameworks, "_FAST_NS", 3600 * 10**9)
    steps = frameworks._Steps()
    steps.labels = {"batch_size": "4"}
    came = []
    for i in range(1, 81):
        came.append(time.time())
        steps.begin(i)
        came.append(time.time())
        steps.end()
    came.append(time.time())
    # The first begin and end go at once (nothing came before them); steps
    # 2 to 65 go together when the 64th of them ends; 15 wait.
    assert d.wait_lines(66)
    assert d.settle() == 66
    memtrack.mark("eval", "start")
    assert d.wait_lines(82)
    objs = d.objects()
    kinds = [(o["type"], o.get("iteration")) for o in objs]
    assert kinds == ([("span_begin", 1), ("span_end", 1)] + [("span_end", i) for i in range(2, 81)]
                     + [("mark", None)])
    assert not {"at", "began"} & (set(objs[0]) | set(objs[1]) | set(objs[-1]))
    for i, o in enumerate(objs[2:-1], start=2):
        # to the µs
        assert came[2 * i - 2] - 1e-6 <= o["began"] <= came[2 * i - 1] + 1e-6, (i, o)
        assert came[2 * i - 1] - 1e-6 <= o["at"] <= came[2 * i] + 1e-6, (i, o)
        assert (o["component"], o["operation"], o["labels"]) == ("train", "step", {"batch_size": "4"})
    assert get_dropped() == 0 and not d.garbled
    # Every message counted once as sent: two for each held step's line.
    assert client_mod.get_client()._sent == 161


def test_a_message_inside_a_held_step_sends_its_begin_first(fake, monkeypatch):
    # A mark made while a held step is open goes after that step's begin:
    # the begin leaves alone, and the step's end follows on its own.
    from memtrack import frameworks

    d = fake()
    monkeypatch.setenv("MEMTRACK_SOCKET", d.path)
    monkeypatch.setattr(client_mod, "_default", None)
    monkeypatch.setattr(client_mod, "_HOLD_NS", 3600 * 10**9)
    monkeypatch.setattr(frameworks, "_FAST_NS", 3600 * 10**9)
    steps = frameworks._Steps()
    for i in range(1, 4):
        steps.begin(i)
        if i == 3:
            memtrack.mark("model", "inside")
        steps.end()
    assert d.wait_lines(5)
    client_mod.get_client().flush()
    assert d.wait_lines(6)
    objs = d.objects()
    kinds = [(o["type"], o.get("iteration"), "began" in o) for o in objs]
    assert kinds == [("span_begin", 1, False), ("span_end", 1, False), ("span_end", 2, True),
                     ("span_begin", 3, False), ("mark", None, False), ("span_end", 3, False)]
    assert "at" in objs[3] and "at" in objs[5]
    assert get_dropped() == 0 and client_mod.get_client()._sent == 7


def test_the_hf_step_hooks_sit_on_the_callback_handler_and_come_off_it(fake, monkeypatch):
    # attach_hf's step path: the trainer's callback handler has its four
    # events wrapped on the instance; each still runs the handler's own
    # (which calls the callbacks in its list) and returns its control; the
    # step begins after the handler's step begin and ends before its step
    # end; a handler without the four is left as it was; detach gives the
    # handler its own events back, and an event the instance had of its
    # own before is kept.
    from memtrack import frameworks

    d = fake()
    monkeypatch.setenv("MEMTRACK_SOCKET", d.path)
    monkeypatch.setattr(client_mod, "_default", None)
    seen = []

    class Handler(object):
        def on_train_begin(self, args, state, control):
            seen.append(("train_begin", control))
            return control + 1

        def on_step_begin(self, args, state, control):
            seen.append(("step_begin", steps.open_at))
            return control + 1

        def on_step_end(self, args, state, control):
            seen.append(("step_end", steps.open_at))
            return control + 1

        def on_train_end(self, args, state, control):
            seen.append(("train_end", control))
            return control + 1

    class Callback(object):
        def __init__(self):
            self._steps = frameworks._Steps()

        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(("mine_train_begin", control))

        def on_train_end(self, args, state, control, **kwargs):
            self._steps.end()
            seen.append(("mine_train_end", control))

    handler, callback = Handler(), Callback()
    steps = callback._steps
    own_train_end = lambda args, state, control: control  # noqa: E731
    handler.on_train_end = own_train_end
    state = types.SimpleNamespace(global_step=0)
    assert frameworks._HandlerHooks.attach(handler, callback)
    assert handler.on_train_begin(None, state, 1) == 2
    for step in range(3):
        state.global_step = step
        assert handler.on_step_begin(None, state, 10) == 11
        assert handler.on_step_end(None, state, 20) == 21
    assert handler.on_train_end(None, state, 30) == 30
    assert seen == ([("train_begin", 1), ("mine_train_begin", 2)]
                    + [("step_begin", None), ("step_end", None)] * 3 + [("mine_train_end", 30)])
    client_mod.get_client().flush()
    assert d.wait_lines(4)
    objs = d.objects()
    assert [o.get("iteration") for o in objs if o["type"] in ("span_begin", "span_end")][:2] == [1, 1]
    assert sorted({o["iteration"] for o in objs}) == [1, 2, 3]

    frameworks._HandlerHooks.detach(handler)
    assert vars(handler) == {"on_train_end": own_train_end}
    assert handler.on_step_begin.__func__ is Handler.on_step_begin

    class Partial(object):
        def on_step_begin(self, args, state, control):
            return control

    partial = Partial()
    assert not frameworks._HandlerHooks.attach(partial, callback)
    assert vars(partial) == {}
    assert not frameworks._HandlerHooks.attach(None, callback)

    class Slotted(object):
        # All four events, but no instance dict to wrap them on.
        __slots__ = ()

    for name in frameworks._HandlerHooks.EVENTS:
        setattr(Slotted, name, lambda self, args, state, control: control)
    assert not frameworks._HandlerHooks.attach(Slotted(), callback)
    frameworks._HandlerHooks.detach(Slotted())


def get_dropped():
    return client_mod.get_client().dropped()


def test_ack_returns_the_entry(fake):
    d = fake()
    c = memtrack.Client(d.path)
    c.mark("a", "before")  # fire-and-forget first: no reply to skip
    entry = c.mark("model", "after_generate", ack=True)
    assert entry["operation"] == "after_generate" and entry["cpu_ram_used_mb"] > 0
    sent = d.objects()[-1]
    assert sent["ack"] is True and isinstance(sent["id"], int)
    assert c.status()["type"] == "status"


def test_ack_error_raises_and_unrelated_replies_are_skipped(fake):
    def responder(obj, pid):
        if obj.get("operation") == "bad":
            # An id-less error for an earlier line, then the real answer.
            return [
                {"ok": False, "error": "parse", "message": "not json"},
                {"ok": False, "error": "invalid", "message": "`labels` has a bad name", "id": obj["id"]},
            ]
        if obj.get("operation") == "busy":
            return {"ok": False, "error": "overloaded", "message": "queue full", "id": obj["id"]}
        return None

    d = fake(responder=responder)
    c = memtrack.Client(d.path)
    with pytest.raises(memtrack.MemtrackError) as err:
        c.mark("a", "bad", ack=True)
    assert err.value.code == "invalid" and "labels" in err.value.message
    # The connection stays usable and in step.
    assert c.mark("a", "good", ack=True)["operation"] == "good"
    assert c.mark("a", "busy", ack=True) is None
    assert c.dropped() == 1  # overloaded counts as a drop


def test_overloaded_replies_to_fire_and_forget_are_drained_and_counted(fake):
    def responder(obj, pid):
        if obj.get("operation") == "shed":
            return {"ok": False, "error": "overloaded", "message": "queue full"}
        return None

    d = fake(responder=responder)
    c = memtrack.Client(d.path)
    for _ in range(200):
        c.mark("a", "shed")
    d.wait_lines(200)
    # The replies are read at the client's drain points: keep marking until
    # they are counted (the daemon answered every one), however slowly they
    # arrive on a loaded machine.
    sent = 0
    deadline = time.monotonic() + 10
    while (sent < 64 or c.dropped() < 150) and time.monotonic() < deadline:
        c.mark("a", "ok")
        sent += 1
        if sent >= 64:
            time.sleep(0.01)
    d.wait_lines(200 + sent)
    assert c.dropped() >= 150
    assert c.mark("a", "x", ack=True)["operation"] == "x"


def test_no_daemon_is_cheap_silent_after_one_warning_and_counted(sockdir):
    c = memtrack.Client(os.path.join(sockdir, "nobody.sock"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for i in range(20000):
            c.mark("model", "step", iteration=i)
        per_call = (time.perf_counter() - t0) / 20000
        assert c.mark("model", "x", ack=True) is None
        with c.span("model", "generate"):
            pass
    assert c.dropped() == 20000 + 1 + 2
    assert len([w for w in caught if issubclass(w.category, memtrack.MemtrackWarning)]) == 1
    assert "nobody.sock" in str(caught[0].message)
    assert caught[0].filename == __file__  # attributed to the caller
    assert per_call < 20e-6, per_call  # ≤ 5 µs is the goal; loose for loaded CI machines


def test_refused_connection_is_retried_every_retry_s(sockdir):
    path = os.path.join(sockdir, "late.sock")
    # A socket file with nobody listening: ECONNREFUSED.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()
    retry_s = 0.3
    c = memtrack.Client(path, retry_s=retry_s)
    refused_before = time.monotonic()  # the refusal comes after this
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c.mark("a", "lost")
    assert c.dropped() == 1
    os.unlink(path)
    from conftest import FakeDaemon

    d = FakeDaemon(path)
    try:
        # Each mark carries the time it was sent: none sent within retry_s
        # of the refusal may reach the daemon (the client must not even
        # try), and one sent after it must, however loaded the machine.
        deadline = time.monotonic() + 10
        sent = 0
        while not d.lines and time.monotonic() < deadline:
            c.mark("a", "try", labels={"sent": "%.6f" % time.monotonic()})
            sent += 1
            time.sleep(0.01)
        assert d.wait_lines(1), "no mark arrived within 10 s of the retry time"
        got = d.objects()
        assert all(o["operation"] == "try" for o in got), got
        early = [o for o in got if float(o["labels"]["sent"]) < refused_before + retry_s]
        assert not early, "sent within retry_s of the refusal, yet tried: %s" % early
    finally:
        d.close()


def test_daemon_restart_is_picked_up(fake, sockdir):
    d = fake()
    c = memtrack.Client(d.path, retry_s=0.2)
    c.mark("a", "one")
    assert d.wait_lines(1)
    d.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            c.mark("a", "gone")
            time.sleep(0.01)
    assert c.dropped() >= 9
    assert len(caught) <= 1
    d2 = fake()
    deadline = time.monotonic() + 3
    while not d2.lines and time.monotonic() < deadline:
        c.mark("a", "back")
        time.sleep(0.05)
    assert d2.objects()[0]["operation"] == "back"


def test_stuck_daemon_never_blocks_and_the_stream_stays_whole(fake):
    d = fake(reading=False)
    c = memtrack.Client(d.path, timeout=0.3)
    n = 100000
    t0 = time.perf_counter()
    for i in range(n):
        c.mark("model", "step", iteration=i, labels={"pad": "x" * 100})
    elapsed = time.perf_counter() - t0
    assert elapsed < 10, elapsed
    dropped = c.dropped()
    assert 0 < dropped < n
    # Resume reading: every line that got through is whole and in order.
    d.resume()
    c.flush(2.0)
    got = d.settle()
    for _ in range(200):  # later marks complete any pending tail first
        c.mark("model", "after")
    got = d.settle()
    assert not d.garbled
    objs = d.objects()
    iters = [o["iteration"] for o in objs if o["operation"] == "step"]
    assert iters == sorted(iters)
    assert len(iters) + dropped == n
    assert got + c.dropped() == n + 200


def test_ack_to_a_stuck_daemon_times_out(fake):
    d = fake(reading=False)
    c = memtrack.Client(d.path, timeout=0.5)
    c.mark("a", "b")
    t0 = time.perf_counter()
    assert c.mark("a", "waits", ack=True) is None
    took = time.perf_counter() - t0
    assert 0.4 < took < 1.5, took
    assert c.dropped() == 1
    assert c.status() is None  # a fresh connection, equally stuck


def test_partial_writes_never_garble_lines(fake):
    # Big messages and a slow reader reading little at a time: sends are
    # partial; the client must finish each message before the next.
    d = fake(read_size=1000, read_delay=0.0005)
    c = memtrack.Client(d.path, timeout=20)
    labels = {"k%d" % i: "v" * 250 for i in range(16)}
    n = 400
    for i in range(n):
        c.mark("big", "step", iteration=i, labels=labels)
    c.flush(5.0)
    assert c.mark("big", "last", ack=True)["operation"] == "last"  # after everything before it
    got = d.settle(quiet=0.3)
    assert not d.garbled
    steps = [o["iteration"] for o in d.objects() if o["operation"] == "step"]
    assert steps == sorted(steps)
    assert len(steps) + c.dropped() == n
    assert d.closed_with_partial == 0
    assert got >= 1


def test_threads_share_one_connection_safely(fake):
    d = fake()
    c = memtrack.Client(d.path)

    def worker(t):
        for i in range(500):
            c.mark("thread%d" % t, "step", iteration=i)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.flush(5.0)
    got = d.settle()
    assert not d.garbled
    assert got + c.dropped() == 4000
    for t in range(8):  # per thread, in order
        its = [o["iteration"] for o in d.objects() if o["component"] == "thread%d" % t]
        assert its == sorted(its)


def test_concurrent_acks_each_get_their_own_reply(fake):
    d = fake()
    c = memtrack.Client(d.path)
    results = {}

    def worker(t):
        results[t] = [c.mark("t%d" % t, "op%d" % i, ack=True)["operation"] for i in range(50)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in range(4):
        assert results[t] == ["op%d" % i for i in range(50)]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_fork_child_opens_its_own_connection(fake, monkeypatch):
    d = fake()
    monkeypatch.setenv("MEMTRACK_SOCKET", d.path)
    monkeypatch.setattr(client_mod, "_default", None)
    memtrack.mark("parent", "before_fork")
    explicit = memtrack.Client(d.path)
    explicit.mark("parent", "explicit_before_fork")
    d.wait_lines(2)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for i in range(200):
                memtrack.mark("child", "step", iteration=i)
                explicit.mark("child", "explicit")
            if memtrack.mark("child", "acked", ack=True) is None:
                code = 3
        except BaseException:
            code = 4
        os._exit(code)
    for i in range(200):
        memtrack.mark("parent", "step", iteration=i)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    d.settle()
    assert not d.garbled
    objs = d.objects()
    child = [o for o in objs if o["component"] == "child"]
    parent = [o for o in objs if o["component"] == "parent"]
    assert len(child) == 401 and len(parent) == 202
    assert {o["_pid"] for o in child} == {pid}
    assert {o["_pid"] for o in parent} == {os.getpid()}
    assert not {o["_conn"] for o in child} & {o["_conn"] for o in parent}


def test_disabled_is_a_no_op(fake, monkeypatch):
    d = fake()
    monkeypatch.setenv("MEMTRACK_DISABLE", "1")
    c = memtrack.Client(d.path)
    assert not c.enabled
    c.mark("a", "b")
    assert c.mark("a", "b", ack=True) is None
    with c.span("a", "b"), c.stage("s"):
        pass
    collected = []
    gc_callback = lambda phase, info: collected.append(phase)  # noqa: E731
    import gc

    gc.callbacks.append(gc_callback)
    try:
        c.clear_memory()  # still frees: only the mark is skipped
    finally:
        gc.callbacks.remove(gc_callback)
    assert "start" in collected
    assert c.status() is None and c.cleanup() is None and c.dropped() == 0
    time.sleep(0.1)
    assert d.conns == 0


def test_no_socket_configured_is_inactive():
    c = memtrack.Client()
    assert not c.enabled
    c.mark("a", "b")
    assert c.dropped() == 0


def test_timeout_from_environment(monkeypatch, sockdir):
    monkeypatch.setenv("MEMTRACK_TIMEOUT", "0.25")
    assert memtrack.Client(os.path.join(sockdir, "x")).timeout == 0.25
    assert memtrack.Client(os.path.join(sockdir, "x"), timeout=2).timeout == 2.0


def test_types_are_checked_locally(sockdir):
    c = memtrack.Client(os.path.join(sockdir, "x"))
    with pytest.raises(TypeError):
        c.mark(1, "b")
    with pytest.raises(TypeError):
        c.mark("a", None)
    with pytest.raises(TypeError):
        c.mark("a", "b", iteration=True)
    with pytest.raises(TypeError):
        c.mark("a", "b", iteration="3")
    with pytest.raises(TypeError):
        c.mark("a", "b", labels={1: "x"})
    with pytest.raises(TypeError):
        c.span("a", 2)
    with pytest.raises(TypeError):
        c.stage(None)
    with pytest.raises(memtrack.MemtrackError) as err:
        c.mark("a", "b", labels={"k": "v" * 70000})
    assert err.value.code == "too_long"


def test_span_as_context_manager_and_decorators(fake):
    d = fake()
    c = memtrack.Client(d.path)

    @c.span("model", "generate", iteration=3)
    def generate(x):
        return x * 2

    @c.span("model", "agen")
    async def agen(x):
        await asyncio.sleep(0.01)
        return x + 1

    assert generate(21) == 42
    assert generate.__name__ == "generate"
    assert asyncio.run(agen(1)) == 2
    with pytest.raises(ValueError):
        with c.span("io", "load", labels={"shard": 1}):
            raise ValueError("boom")
    d.wait_lines(6)
    got = [(o["type"], o["component"], o["operation"]) for o in d.objects()]
    assert got == [
        ("span_begin", "model", "generate"),
        ("span_end", "model", "generate"),
        ("span_begin", "model", "agen"),
        ("span_end", "model", "agen"),
        ("span_begin", "io", "load"),
        ("span_end", "io", "load"),
    ]
    assert d.objects()[0]["iteration"] == 3
    assert d.objects()[4]["labels"] == {"shard": "1"}


def test_stage_success_and_failure(fake):
    d = fake()
    c = memtrack.Client(d.path)
    with c.stage("load", labels={"n": 1}):
        pass
    with pytest.raises(RuntimeError):
        with c.stage("train"):
            raise RuntimeError("é" * 2000)

    @c.stage("eval")
    def evaluate():
        return "ok"

    assert evaluate() == "ok"
    d.wait_lines(6)
    objs = d.objects()
    assert [(o["type"], o["name"], o.get("status")) for o in objs] == [
        ("stage_begin", "load", None),
        ("stage_end", "load", "SUCCESS"),
        ("stage_begin", "train", None),
        ("stage_end", "train", "FAILED"),
        ("stage_begin", "eval", None),
        ("stage_end", "eval", "SUCCESS"),
    ]
    message = objs[3]["message"]
    assert message.startswith("RuntimeError('éé")
    assert len(message.encode("utf-8")) <= 1024
    assert objs[0]["labels"] == {"n": "1"}


def test_status_and_cleanup(fake):
    d = fake()
    c = memtrack.Client(d.path)
    assert c.status()["ok"] is True
    assert c.cleanup() == 0


def test_notices_run_handlers(fake):
    d = fake()
    c = memtrack.Client(d.path)
    seen = []
    got_cleanup = threading.Event()
    got_pressure = threading.Event()

    @c.on_cleanup
    def no_args():
        seen.append("cleanup()")
        got_cleanup.set()

    c.on_cleanup(lambda notice: seen.append("cleanup:" + notice["reason"]))
    c.on_pressure(lambda notice: (seen.append("pressure:" + notice["level"]), got_pressure.set()))
    assert c.wait_subscribed(5)
    assert d.wait_subscribers(1)
    assert c.cleanup() == 1
    assert got_cleanup.wait(5)
    d.push({"type": "pressure", "resource": "host", "level": "high", "previous": "normal", "used_ratio": 0.8})
    assert got_pressure.wait(5)
    time.sleep(0.05)
    assert seen == ["cleanup()", "cleanup:socket", "pressure:high"]
    assert d.conns == 2  # one for marks/requests, one subscribed


def test_handler_errors_do_not_kill_the_subscriber(fake):
    d = fake()
    c = memtrack.Client(d.path)
    ok = threading.Event()
    c.on_cleanup(lambda: 1 / 0)
    c.on_cleanup(ok.set)
    assert c.wait_subscribed(5)
    d.push({"type": "cleanup", "reason": "test", "timestamp": 0})
    assert ok.wait(5)


def test_subscriber_reconnects_after_a_daemon_restart(fake):
    d = fake()
    c = memtrack.Client(d.path, retry_s=0.2)
    hits = []
    c.on_cleanup(lambda: hits.append(1))
    assert c.wait_subscribed(5)
    d.close()
    d2 = fake()
    assert d2.wait_subscribers(1, timeout=5)
    d2.push({"type": "cleanup", "reason": "test", "timestamp": 0})
    deadline = time.monotonic() + 5
    while not hits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hits == [1]


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_auto_cleanup_on_pressure_is_rate_limited(fake):
    d = fake()
    c = memtrack.Client(d.path)
    c.enable_auto_cleanup("critical", min_interval=0.5)
    assert d.wait_subscribers(1)
    seen = []
    c.on_pressure(seen.append)

    def clears():
        return [o for o in d.objects() if o.get("operation") == "clear_memory"]

    notice = {"type": "pressure", "resource": "gpu0", "level": "high", "previous": "normal", "used_ratio": 0.8}
    d.push(notice)  # below the level: nothing
    assert _wait_for(lambda: len(seen) == 1)
    d.push(dict(notice, level="critical"))
    d.push(dict(notice, level="emergency"))  # within min_interval: skipped
    assert _wait_for(lambda: len(seen) == 3)
    assert _wait_for(lambda: len(clears()) == 1)
    time.sleep(0.1)
    assert [(o["component"], o["type"]) for o in clears()] == [("system", "mark")]
    time.sleep(0.6)  # past min_interval: a cleanup notice clears again
    d.push({"type": "cleanup", "reason": "http", "timestamp": 0})
    assert _wait_for(lambda: len(clears()) == 2)


class _FakeCuda:
    def __init__(self, initialized=True, broken=False):
        self.initialized = initialized
        self.broken = broken
        self.emptied = 0

    def is_initialized(self):
        return self.initialized

    def _fig(self, value):
        if self.broken:
            raise RuntimeError("CUDA error: device lost")
        return value

    def memory_allocated(self):
        return self._fig(1 << 30)

    def memory_reserved(self):
        return self._fig(2 << 30)

    def max_memory_allocated(self):
        return self._fig(3 << 30)

    def current_device(self):
        return 1

    def empty_cache(self):
        self.emptied += 1

    def reset_peak_memory_stats(self):
        self._fig(None)
        self.resets = getattr(self, "resets", 0) + 1


def test_allocator_figures_only_when_cuda_is_already_in_use(fake, monkeypatch):
    d = fake()
    c = memtrack.Client(d.path)
    c.mark("a", "no_torch")
    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = _FakeCuda(initialized=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    c.mark("a", "not_initialized")
    c.clear_memory()
    assert fake_torch.cuda.emptied == 0
    fake_torch.cuda.initialized = True
    c.mark("a", "initialized")
    c.mark("a", "opted_out", allocator=False)
    with c.span("model", "generate"):
        pass
    c.clear_memory("data")
    assert fake_torch.cuda.emptied == 1
    fake_torch.cuda.broken = True
    c.mark("a", "broken")
    assert d.wait_lines(9)
    objs = {(o["operation"] if "operation" in o else o["type"]): o for o in d.objects()}
    assert "allocator" not in objs["no_torch"] and "allocator" not in objs["not_initialized"]
    assert objs["initialized"]["allocator"] == {
        "allocated": 1 << 30,
        "reserved": 2 << 30,
        "max_allocated": 3 << 30,
        "device": 1,
    }
    assert "allocator" not in objs["opted_out"]
    assert objs["generate"]["allocator"]["allocated"] == 1 << 30
    assert objs["clear_memory"]["component"] == "data"
    assert "allocator" not in objs["broken"]


def test_a_step_naming_its_batch_size_starts_its_own_allocator_peak(fake, monkeypatch):
    d = fake()
    c = memtrack.Client(d.path)
    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = _FakeCuda(initialized=True)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with c.span("train", "step", labels={"batch_size": 64}):
        assert fake_torch.cuda.resets == 1
    with c.span("eval", "step"):
        pass
    assert fake_torch.cuda.resets == 1, "only a span that names its batch size resets"
    fake_torch.cuda.broken = True
    with c.span("train", "step", labels={"batch_size": 64}):
        pass
    assert d.wait_lines(6)
    ends = [o for o in d.objects() if o["type"] == "span_end"]
    # The end mark carries the step's peak since the reset.
    assert ends[0]["allocator"]["max_allocated"] == 3 << 30


def test_client_never_imports_torch():
    import subprocess

    code = (
        "import sys; sys.path.insert(0, %r); import memtrack; memtrack.mark('a','b'); "
        "memtrack.clear_memory(); print('torch' in sys.modules)" % os.path.dirname(memtrack.__path__[0])
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_module_level_api_uses_the_environment(fake, monkeypatch):
    d = fake()
    monkeypatch.setenv("MEMTRACK_SOCKET", d.path)
    monkeypatch.setattr(client_mod, "_default", None)
    memtrack.mark("m", "x")
    assert memtrack.mark("m", "y", ack=True)["operation"] == "y"
    with memtrack.span("m", "s"), memtrack.stage("st"):
        pass
    assert memtrack.status()["ok"]
    assert memtrack.dropped() == 0
    d.wait_lines(7)
    got = [(o["type"], o.get("operation", o.get("name"))) for o in d.objects()]
    assert got == [
        ("mark", "x"),
        ("mark", "y"),
        ("span_begin", "s"),
        ("stage_begin", "st"),
        ("stage_end", "st"),
        ("span_end", "s"),
        ("status", None),
    ]
    assert len({o["_conn"] for o in d.objects()}) == 1


def test_marks_from_a_signal_handler_never_deadlock_or_garble(fake):
    import signal

    d = fake()
    c = memtrack.Client(d.path)
    fired = []

    def handler(signum, frame):
        fired.append(1)
        c.mark("signal", "handler", labels={"pad": "y" * 300})

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
    try:
        for i in range(20000):
            c.mark("main", "step", iteration=i, labels={"pad": "x" * 300})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert c.flush(5.0)  # a partly sent last message is neither got nor dropped yet
    got = d.settle()
    assert fired
    assert not d.garbled
    assert got + c.dropped() == 20000 + len(fired)
    its = [o["iteration"] for o in d.objects() if o["component"] == "main"]
    assert its == sorted(its)


# -- the job's own ClearML task ---------------------------------------------


@pytest.fixture
def fake_clearml(monkeypatch):
    """A stand-in for the ClearML SDK: Task.init sets the main task, close
    records when it ran. The client's state starts and ends fresh."""
    events = []

    class Task(object):
        _Task__main_task = None
        failure = None   # the exception the job's exit hook saw

        def __init__(self, tid):
            self.id = tid

        @classmethod
        def init(cls, tid):
            cls._Task__main_task = cls(tid)
            return cls._Task__main_task

        @classmethod
        def current_task(cls):
            raise AssertionError("never called: it would create a task in a subprocess")

        def close(self):
            events.append(("close", time.monotonic()))
            self._Task__shutdown()

        # The SDK's shutdown sets the final status with these.
        def _Task__shutdown(self):
            if self.failure:
                self.mark_failed(status_reason=self.failure)
            else:
                self.mark_completed()

        def mark_completed(self, ignore_errors=True, status_message=None, force=False):
            events.append(("completed", None))

        def mark_failed(self, ignore_errors=True, status_reason=None, status_message=None, force=False):
            events.append(("failed", status_reason))

        def stopped(self, ignore_errors=True, force=False, status_reason=None, status_message=None):
            events.append(("stopped", status_reason))

    module = types.ModuleType("clearml")
    module.Task = Task
    monkeypatch.setitem(sys.modules, "clearml", module)
    fresh = {"next": 0.0, "retry_at": 0.0, "task": None, "done": None, "reply": None,
             "patched": False, "closing": None, "path": None}
    monkeypatch.setattr(client_mod, "_clearml_state", dict(fresh))
    yield Task, events
    client_mod._clearml_wait(5)


def test_the_sdks_task_is_announced_once_on_its_own_connection(fake, fake_clearml):
    Task, events = fake_clearml
    answered = []

    def responder(obj, pid):
        if obj.get("type") == "clearml_task":
            time.sleep(0.3)   # the daemon registers the artifact first
            answered.append(time.monotonic())
            return {"ok": True, "type": "clearml_task", "id": obj["id"], "clearml": True,
                    "task": obj["task"], "reporting": True, "artifact": True, "message": "ok"}
        if obj.get("type") == "clearml_close":
            return {"ok": True, "type": "clearml_close", "id": obj["id"], "deferred": False,
                    "message": "the SDK sets its status"}
        return None

    d = fake(responder=responder)
    c = memtrack.Client(d.path)
    c.mark("model", "before_init")           # no task yet: nothing announced
    task = Task.init("0123456789abcdef0123456789abcdef")
    for i in range(20):
        c.mark("model", "step", iteration=i)
    with c.span("model", "generate"):
        pass
    task.close()                             # waits for the daemon's answer
    assert answered and events and events[0][1] >= answered[0]
    d.settle()
    objs = d.objects()
    announced = [o for o in objs if o.get("type") == "clearml_task"]
    assert len(announced) == 1, objs
    assert announced[0]["task"] == "0123456789abcdef0123456789abcdef"
    assert announced[0]["ack"] is True
    marks = [o for o in objs if o.get("type") != "clearml_task"]
    assert announced[0]["_conn"] not in {o["_conn"] for o in marks}
    assert client_mod._clearml_state["reply"]["reporting"] is True
    assert memtrack.clearml_announce(client=c, wait=True)["artifact"] is True   # the same answer
    # The daemon did not take the close over: the SDK completed the task.
    assert [e[0] for e in events] == ["close", "completed"]


def test_the_sdks_close_is_left_to_a_daemon_that_takes_it_over(fake, fake_clearml):
    Task, events = fake_clearml
    offered = []

    def responder(obj, pid):
        if obj.get("type") == "clearml_task":
            return {"ok": True, "type": "clearml_task", "id": obj["id"], "clearml": True,
                    "task": obj["task"], "reporting": True, "artifact": True, "message": "ok"}
        if obj.get("type") == "clearml_close":
            offered.append(obj)
            return {"ok": True, "type": "clearml_close", "id": obj["id"], "clearml": True,
                    "deferred": True, "message": "memtrack marks it"}
        return None

    d = fake(responder=responder)
    c = memtrack.Client(d.path)
    task = Task.init("t-1")
    task.failure = "Exception boom\nat step 5\x00"
    c.mark("model", "step", iteration=0)
    assert memtrack.clearml_announce(client=c, wait=True)["artifact"] is True
    # A status set outside the SDK's shutdown is the job's own: not offered.
    task.stopped(status_reason="by hand")
    task.close()
    assert [e[0] for e in events] == ["stopped", "close"], events   # the SDK left it
    assert len(offered) == 1, offered
    assert offered[0]["task"] == "t-1" and offered[0]["status"] == "failed"
    assert offered[0]["message"] == "Exception boom at step 5", offered[0]
    assert offered[0]["ack"] is True
    assert client_mod._clearml_state["closing"] is None


@pytest.mark.filterwarnings("ignore::memtrack.MemtrackWarning")
def test_without_an_artifact_the_sdk_keeps_its_close(fake, fake_clearml):
    Task, events = fake_clearml

    def responder(obj, pid):
        if obj.get("type") == "clearml_task":
            return {"ok": True, "type": "clearml_task", "id": obj["id"], "clearml": True,
                    "task": obj["task"], "reporting": True, "artifact": False, "message": "ok"}
        return None

    d = fake(responder=responder)
    c = memtrack.Client(d.path)
    task = Task.init("t-2")
    assert memtrack.clearml_announce(client=c, wait=True)["reporting"] is True
    task.close()
    assert [e[0] for e in events] == ["close", "completed"]
    d.settle()
    assert not [o for o in d.objects() if o.get("type") == "clearml_close"]


@pytest.mark.filterwarnings("ignore::memtrack.MemtrackWarning")  # "no memtrack daemon"
def test_without_a_task_or_a_daemon_nothing_waits(fake, fake_clearml, sockdir):
    Task, events = fake_clearml
    d = fake()
    c = memtrack.Client(d.path)
    c.mark("model", "x")
    assert memtrack.clearml_announce(client=c) is None           # no task made yet
    d.settle()
    assert all(o.get("type") != "clearml_task" for o in d.objects())
    # A task, but no daemon behind the socket: the announcement gives up at
    # once and the SDK's close does not wait.
    gone = memtrack.Client(os.path.join(sockdir, "nobody.sock"))
    task = Task.init("abc")
    assert memtrack.clearml_announce(client=gone, wait=True) is None
    assert client_mod._clearml_state["done"].is_set()    # close will not wait
    assert client_mod._clearml_state["task"] is None     # announced again later
    task.close()
    assert events
