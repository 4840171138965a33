"""The memtrack event client: docs/protocol.md, spoken from Python.

Standard library only. It never imports torch and never initialises CUDA: the
allocator figures are read only when the job has already imported torch and
initialised CUDA itself.

Design (see README.md for the user-facing contract):

- one persistent, non-blocking ``SOCK_STREAM`` connection per process and
  client; a fire-and-forget message is one ``send()`` under a small lock;
- a partial write leaves the unsent tail of *that* message in ``_pending``,
  completed before anything else is written (the line stream is never
  corrupted); while it cannot be completed, new messages are dropped and
  counted;
- no daemon (or a daemon gone): drop, count, warn once per process, and try
  to connect again at most every ``retry_s`` seconds (a monotonic-clock check);
- ``ack`` requests carry an integer ``id`` and wait for the reply with that
  id, so error replies to earlier fire-and-forget messages never answer them;
- fork: ``os.register_at_fork`` resets every client in the child, which opens
  its own connection (a shared socket would interleave two processes' bytes).
"""

import atexit
import collections
import errno
import functools
import gc
import json
import logging
import operator
import os
import select
import socket
import struct
import sys
import threading
import time
import warnings
import weakref

__all__ = [
    "Client",
    "MemtrackError",
    "MemtrackWarning",
    "MAX_LINE",
    "get_client",
    "mark",
    "span",
    "stage",
    "clear_memory",
    "on_cleanup",
    "on_pressure",
    "enable_auto_cleanup",
    "wait_subscribed",
    "status",
    "cleanup",
    "clearml_announce",
    "dropped",
]

#: Longest line the daemon accepts, newline included.
MAX_LINE = 65536
#: Longest stage_end message, in UTF-8 bytes.
MAX_MESSAGE = 1024
#: Pressure levels, lowest first.
LEVELS = ("normal", "high", "critical", "emergency")
_LEVEL_RANK = {name: i for i, name in enumerate(LEVELS)}

_DEFAULT_TIMEOUT = 1.0
_RETRY_S = 5.0
# A connection that dies younger than this is not retried at once (a daemon
# that accepts and closes, e.g. `refused`, must not cost a connect per mark).
_SHORT_LIVED_S = 1.0
# Asked for at connect; the kernel doubles it and caps it at wmem_max. A
# bigger send buffer absorbs bursts of marks while the daemon is descheduled.
_SNDBUF = 1 << 20
# Unread replies are drained every this many fire-and-forget sends (a power of
# two minus one, used as a mask); the daemon closes a connection with 256
# unread replies.
_DRAIN_MASK = 63
_SUBSCRIBE_LINE = b'{"type":"subscribe"}\n'
# Step messages that come faster than _FAST_NS apart are held back and sent
# together (each saying when it happened), once the first of them is
# _HOLD_NS old or _HOLD_MAX wait: the daemon, which would otherwise wake (and
# on a busy node take the job's core) at every message, wakes at most five
# times a second for them, and a send's fixed cost is shared by the steps of
# 200 ms (forty of 5 ms) or 256 steps. Slower steps are sent at once.
# In nanoseconds (``time.time_ns()``): a held message says when it came as
# an integer and an exponent, ``"at":1795796798467141528e-9``, which
# formats three times faster than a float and is the same JSON number.
_FAST_NS = 10_000_000
_HOLD_NS = 200_000_000
_HOLD_MAX = 256

_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_monotonic = time.monotonic
_modules = sys.modules
_encode = json.JSONEncoder(separators=(",", ":")).encode
_log = logging.getLogger("memtrack")
# How often a client looks for the job's ClearML task, and how long the
# announcement (and the SDK's close waiting for it) may take.
_CLEARML_CHECK_S = 1.0
_CLEARML_TIMEOUT = 30.0
_MISSING = object()


class MemtrackError(Exception):
    """An error reply from the daemon to a request that waited for one.

    ``code`` is the protocol's error code (``invalid``, ``parse``,
    ``unknown_type``, ``unsupported_version``, ``too_long``, ``refused``),
    ``message`` the daemon's explanation and ``reply`` the whole reply.
    """

    def __init__(self, code, message="", reply=None):
        super().__init__("%s: %s" % (code, message) if message else str(code))
        self.code = code
        self.message = message
        self.reply = reply


class MemtrackWarning(RuntimeWarning):
    """Issued once per process when the daemon cannot be reached."""


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_timeout():
    raw = os.environ.get("MEMTRACK_TIMEOUT", "").strip()
    if not raw:
        return _DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects NaN
        _warn("MEMTRACK_TIMEOUT=%r is not a number of seconds >= 0; using %s s" % (raw, _DEFAULT_TIMEOUT))
        return _DEFAULT_TIMEOUT
    return value


def _warn(text):
    """warnings.warn, attributed to the first caller outside this package,
    and never raising into the job (even under ``-W error``)."""
    level = 1
    try:
        frame = sys._getframe(0)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("memtrack"):
            frame = frame.f_back
            level += 1
    except Exception:
        level = 2
    try:
        warnings.warn(text, MemtrackWarning, stacklevel=level)
    except Exception:
        pass


def _allocator_figures():
    """PyTorch's caching-allocator figures, or None. Only when the job has
    already imported torch and initialised CUDA; never imports anything."""
    torch = _modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        figures = {
            "allocated": int(cuda.memory_allocated()),
            "reserved": int(cuda.memory_reserved()),
            "max_allocated": int(cuda.max_memory_allocated()),
        }
    except Exception:
        return None
    try:
        figures["device"] = int(cuda.current_device())
    except Exception:
        pass
    return figures


def _cuda_in_use(torch):
    try:
        return torch.cuda.is_initialized()
    except Exception:
        return False


def _prebuilt_head(kind, fields):
    """The bytes of a message up to the value of its ``iteration`` (the
    last field, an int): ``fields`` are checked fields without it. The head
    is the general path's encoding, so both give the daemon the same line."""
    msg = {"type": kind}
    msg.update(fields)
    msg["iteration"] = 0
    data = _encode(msg)
    if not data.endswith(',"iteration":0}'):
        raise MemtrackError("bad_request", "iteration must be the last field")
    head = data[: -len("0}")].encode()
    if len(head) + 24 > MAX_LINE:
        raise MemtrackError("too_long", "message of %d bytes; the protocol allows %d" % (len(head), MAX_LINE))
    return head


def _reset_step_peak():
    """Starts the allocator's per-step peak: torch.cuda.reset_peak_memory_stats()
    when the job already uses CUDA, so that max_memory_allocated() at the
    step's end is that step's own peak. Never imports anything."""
    torch = _modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
    except Exception:
        pass


def _check_name(value, what):
    if not isinstance(value, str):
        raise TypeError("memtrack: %s must be a str, not %s" % (what, type(value).__name__))


def _check_iteration(iteration):
    if iteration.__class__ is int:
        return iteration
    if isinstance(iteration, bool):
        raise TypeError("memtrack: iteration must be an int, not bool")
    try:
        return operator.index(iteration)  # numpy integers and the like
    except TypeError:
        raise TypeError("memtrack: iteration must be an int, not %s" % type(iteration).__name__) from None


def _check_labels(labels):
    """A dict of str → str. Values that are not str are converted with str()
    (``labels={"batch_size": 128}`` is fine); names must be str."""
    if not isinstance(labels, dict):
        try:
            labels = dict(labels)
        except (TypeError, ValueError):
            raise TypeError("memtrack: labels must be a dict of str to str, not %s" % type(labels).__name__) from None
    out = labels
    for key, value in labels.items():
        if not isinstance(key, str):
            raise TypeError("memtrack: label names must be str, not %s" % type(key).__name__)
        if not isinstance(value, str):
            if out is labels:
                out = dict(labels)
            out[key] = str(value)
    return out


def _truncate_utf8(text, limit):
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")


def _fields(component, operation, iteration, labels):
    _check_name(component, "component")
    _check_name(operation, "operation")
    fields = {"component": component, "operation": operation}
    if iteration is not None:
        fields["iteration"] = _check_iteration(iteration)
    if labels:
        fields["labels"] = _check_labels(labels)
    return fields


def _line(msg):
    data = (_encode(msg) + "\n").encode()
    if len(data) > MAX_LINE:
        raise MemtrackError("too_long", "message of %d bytes; the protocol allows %d" % (len(data), MAX_LINE))
    return data


def _count_overloaded(lines):
    n = 0
    for line in lines.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("error") == "overloaded":
            n += 1
    return n


def _wait_fd(sock, events, timeout):
    """True when ``sock`` is ready for ``events`` within ``timeout`` seconds."""
    try:
        poller = select.poll()
        poller.register(sock.fileno(), events)
        return bool(poller.poll(max(0, int(timeout * 1000.0) + 1)))
    except (OSError, ValueError):
        return False


def _accepts_one_argument(handler):
    try:
        import inspect

        inspect.signature(handler).bind(None)
        return True
    except TypeError:
        return False
    except ValueError:  # no signature (some builtins): pass the notice
        return True


class Client:
    """One process's connection to the memtrack daemon.

    ``path``: the daemon's socket, default ``$MEMTRACK_SOCKET``; without one
    the client is inactive (every call is a no-op, nothing is counted).
    ``timeout``: seconds an ``ack``/``status``/``cleanup`` call waits for its
    reply, default ``$MEMTRACK_TIMEOUT`` or 1.0. ``disabled``: default
    ``$MEMTRACK_DISABLE``; a disabled client does nothing at all.

    Thread-safe. Fork-safe: in a forked child every client starts over with
    no connection (opened again on first use), no subscription and zeroed
    counters.
    """

    def __init__(self, path=None, timeout=None, *, disabled=None, retry_s=_RETRY_S):
        if path is None:
            path = os.environ.get("MEMTRACK_SOCKET") or None
        if path is not None:
            path = os.fspath(path)
        if timeout is None:
            timeout = _env_timeout()
        elif not timeout >= 0:
            raise ValueError("memtrack: timeout must be >= 0")
        if disabled is None:
            disabled = _env_flag("MEMTRACK_DISABLE")
        self.path = path
        self.timeout = float(timeout)
        self.retry_s = float(retry_s)
        #: False when disabled or without a socket path: every call is a no-op.
        self.enabled = bool(path) and not disabled
        self._off = not self.enabled
        self._reset()
        _clients.add(self)

    # -- state -------------------------------------------------------------

    def _reset(self):
        """Fresh per-process state (also the child's state after a fork)."""
        # The connection, pending bytes and counters. Reentrant, with _busy
        # marking a section in progress: a signal handler or finalizer that
        # marks while this thread is inside a section drops its message
        # instead of deadlocking or writing into a half-sent one.
        self._lock = threading.RLock()
        self._busy = False
        self._rlock = threading.Lock()  # one reader of replies at a time
        self._sock = None
        self._connected_at = 0.0
        self._pending = b""  # unsent tail of the message(s) being written
        # (head, iteration, when) of step messages held back: appended
        # without the lock (a deque's append and popleft are atomic), taken
        # under it.
        self._held = collections.deque()
        self._cuda = False  # the job was seen using CUDA
        self._written = 0  # bytes handed to the kernel on this connection
        self._rbuf = b""  # a partial reply line
        self._waiting = set()  # ids of ack requests waiting for replies
        self._stash = {}  # replies read by one waiter for another
        self._next_id = 0
        self._retry_at = 0.0
        self._sent = 0
        self._dropped = 0
        # Drops of calls that re-entered a section (signal handlers, which
        # can nest): one list.append each, atomic under the GIL, so neither
        # an interrupted `_dropped += 1` nor a nested handler loses a count.
        self._reentrant = []
        self._warned = False
        self._pid = os.getpid()
        # Subscription (on_cleanup / on_pressure / enable_auto_cleanup).
        self._sub_lock = threading.Lock()
        self._listener = None
        self._listen_sock = None
        self._listen_stop = threading.Event()
        self._subscribed = threading.Event()
        self._cleanup_handlers = []
        self._pressure_handlers = []
        self._auto_level = None
        self._auto_min_interval = 5.0
        self._auto_last = None
        self._auto_lock = threading.Lock()

    def _after_fork_in_child(self):
        # Close (never shutdown) the inherited descriptors: that releases the
        # child's references only; the parent's connections are untouched.
        for sock in (self._sock, self._listen_sock):
            if sock is not None:
                try:
                    sock.close()
                except Exception:
                    pass
        self._reset()

    def __repr__(self):
        state = "disabled" if self._off else ("connected" if self._sock is not None else "not connected")
        return "<memtrack.Client %r %s, %d dropped>" % (self.path, state, self.dropped())

    # -- the connection (callers hold self._lock) --------------------------

    def _enter(self):
        """Take the lock for a section; False (lock not held) when this
        thread is already inside one (re-entered from a signal handler)."""
        self._lock.acquire()
        if self._busy:
            self._lock.release()
            return False
        self._busy = True
        return True

    def _leave(self):
        self._busy = False
        self._lock.release()

    def _connect_locked(self, now):
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            except OSError:
                pass
            # Non-blocking: a daemon whose accept backlog is full gives
            # EAGAIN at once instead of stalling the job.
            sock.connect(self.path)
            _check_owner(sock)
        except OSError as exc:
            if sock is not None:
                sock.close()
            self._retry_at = now + self.retry_s
            self._warn_once("no memtrack daemon at %s (%s)" % (self.path, _describe(exc)))
            return None
        self._sock = sock
        self._connected_at = now
        self._pending = b""
        self._written = 0
        self._rbuf = b""
        return sock

    def _lost_locked(self, sock, why):
        """Forget ``sock`` (the daemon closed it, or it timed out)."""
        if self._sock is not sock:
            return
        self._sock = None
        self._pending = b""  # the tail of a message is garbage on a new connection
        self._rbuf = b""
        self._stash.clear()
        try:
            sock.close()
        except Exception:
            pass
        now = _monotonic()
        self._retry_at = now + (self.retry_s if now - self._connected_at < _SHORT_LIVED_S else 0.0)
        if why is not None:
            self._warn_once("lost the connection to the memtrack daemon at %s (%s)" % (self.path, why))

    def _warn_once(self, what):
        if self._warned:
            return
        self._warned = True
        _warn(
            "memtrack: %s; marks are dropped and counted (memtrack.dropped()) "
            "and the client tries again every %g s" % (what, self.retry_s)
        )

    def _flush_locked(self, sock):
        """Try to write the pending tail; True when nothing is left."""
        try:
            n = sock.send(self._pending, _NOSIGNAL)
        except BlockingIOError:
            return False
        except OSError as exc:
            self._lost_locked(sock, _describe(exc))
            return False
        self._written += n
        self._pending = self._pending[n:]
        return not self._pending

    def _drain_locked(self, sock):
        """Read and discard unread replies (error replies to fire-and-forget
        messages), counting ``overloaded`` ones as dropped. Only while no
        ack request is waiting, so no awaited reply is consumed here."""
        try:
            chunk = sock.recv(MAX_LINE)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost_locked(sock, _describe(exc))
            return
        if not chunk:
            self._lost_locked(sock, "the daemon closed it")
            return
        buf = self._rbuf + chunk
        cut = buf.rfind(b"\n") + 1
        self._rbuf = buf[cut:]
        if cut and b"overloaded" in buf:
            self._dropped += _count_overloaded(buf[:cut])

    def _take_held(self):
        """The held step messages as lines, each saying when it happened,
        and how many messages they stand for; the caller holds the lock. One
        appended meanwhile (from another thread) waits for the next send. A
        step held by :meth:`_held_step` whose end came goes as one
        ``span_end`` line saying when it began; one still open goes as its
        ``span_begin``, and its end follows on its own.

        The record, ``[begin head, iteration, began, end head]``, gets its
        fifth slot by one append, the step's end's (its time) or this
        method's (None), whichever comes first: the end goes out once
        whatever the threads do."""
        held = self._held
        pop = held.popleft
        lines = []
        count = 0
        for _ in range(len(held)):
            item = pop()
            if item.__class__ is tuple:
                lines.append(b'%s%d,"at":%de-9}\n' % item)
                count += 1
                continue
            # Claim the step's end slot (see above).
            item.append(None)
            head, iteration, began, end_head, ended = item[:5]
            if ended is None:
                lines.append(b'%s%d,"at":%de-9}\n' % (head, iteration, began))
                count += 1
            else:
                lines.append(b'%s%d,"at":%de-9,"began":%de-9}\n' % (end_head, iteration, ended, began))
                count += 2
        return b"".join(lines), count

    def _send(self, data):
        """Fire-and-forget: one non-blocking send, or a counted drop. Step
        messages held back (:meth:`_prebuilt`) go first, so the daemon reads
        every message in the order the job sent it."""
        lock = self._lock
        lock.acquire()
        if self._busy:  # re-entered from a signal handler mid-send
            lock.release()
            self._reentrant.append(1)
            return
        self._busy = True
        try:
            # Messages in this send: the held ones, and `data` when given.
            count = 1 if data else 0
            if self._held:
                lines, n = self._take_held()
                data = lines + data
                count += n
            sock = self._sock
            if sock is None:
                now = _monotonic()
                if now < self._retry_at:
                    self._dropped += count
                    return
                sock = self._connect_locked(now)
                if sock is None:
                    self._dropped += count
                    return
            if self._pending and not self._flush_locked(sock):
                self._dropped += count
                return
            if not data:
                return
            try:
                n = sock.send(data, _NOSIGNAL)
            except BlockingIOError:
                self._dropped += count
                return
            except OSError as exc:
                self._lost_locked(sock, _describe(exc))
                self._dropped += count
                return
            self._written += n
            if n != len(data):
                self._pending = data[n:]
            self._sent += count
            if not self._sent & _DRAIN_MASK:
                if not self._waiting:
                    self._drain_locked(sock)
                if len(self._reentrant) > 4096:  # keep the list small
                    folded, self._reentrant = self._reentrant, []
                    self._dropped += len(folded)
        finally:
            self._busy = False
            lock.release()

    def _drop(self):
        if not self._enter():
            self._reentrant.append(1)
            return
        self._dropped += 1
        self._leave()

    # -- requests that wait for a reply -------------------------------------

    def _request(self, msg, timeout=None):
        """Send ``msg`` with a fresh id and return the reply with that id, or
        None (no daemon, connection lost, or no reply within the timeout;
        counted as dropped)."""
        if self._off:
            return None
        if timeout is None:
            timeout = self.timeout
        deadline = _monotonic() + timeout
        if not self._enter():
            self._reentrant.append(1)
            return None
        try:
            sock = self._sock
            if sock is None:
                # A request that waits anyway tries to connect now,
                # regardless of the fire-and-forget retry interval.
                sock = self._connect_locked(_monotonic())
                if sock is None:
                    self._dropped += 1
                    return None
            self._next_id += 1
            rid = self._next_id
            msg["id"] = rid
            data = _line(msg)
            if self._held:
                lines, n = self._take_held()
                self._sent += n
                data = lines + data
            self._waiting.add(rid)
            if self._pending:
                self._pending += data  # whole messages only: the stream stays intact
            else:
                try:
                    n = sock.send(data, _NOSIGNAL)
                except BlockingIOError:
                    n = 0
                except OSError as exc:
                    self._lost_locked(sock, _describe(exc))
                    self._waiting.discard(rid)
                    self._dropped += 1
                    return None
                self._written += n
                if n != len(data):
                    self._pending = data[n:]
            end = self._written + len(self._pending)
        finally:
            self._leave()
        reply = None
        try:
            if self._wait_written(sock, end, deadline):
                reply = self._read_reply(sock, rid, deadline)
        finally:
            if self._enter():
                try:
                    self._waiting.discard(rid)
                    self._stash.pop(rid, None)
                    if reply is None:
                        # No reply in time: a late one would answer the next
                        # request on this connection, so the connection goes.
                        self._lost_locked(sock, None)
                        self._dropped += 1
                finally:
                    self._leave()
        return reply

    def _wait_written(self, sock, end, deadline):
        """Wait (outside the lock) until our bytes are all in the kernel."""
        while True:
            if not self._enter():
                return False
            try:
                if self._sock is not sock:
                    return False
                if self._written < end and self._pending:
                    self._flush_locked(sock)
                if self._sock is not sock:
                    return False
                if self._written >= end:
                    return True
            finally:
                self._leave()
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return False
            _wait_fd(sock, select.POLLOUT, remaining)

    def _read_reply(self, sock, rid, deadline):
        remaining = deadline - _monotonic()
        if remaining <= 0 or not self._rlock.acquire(timeout=remaining):
            return None
        try:
            if not self._enter():
                return None
            try:
                if self._sock is not sock:
                    return None
                buf = self._rbuf
                self._rbuf = b""
            finally:
                self._leave()
            overloaded = 0
            try:
                while True:
                    reply = self._stash.pop(rid, None)
                    if reply is not None:
                        return reply
                    while True:
                        cut = buf.find(b"\n")
                        if cut < 0:
                            break
                        line = buf[:cut]
                        buf = buf[cut + 1 :]
                        try:
                            obj = json.loads(line)
                        except ValueError:
                            continue
                        if not isinstance(obj, dict):
                            continue
                        other = obj.get("id")
                        if other == rid:
                            return obj
                        if other in self._waiting:
                            self._stash[other] = obj
                        elif obj.get("error") == "overloaded":
                            overloaded += 1
                    remaining = deadline - _monotonic()
                    if remaining <= 0 or self._sock is not sock:
                        return None
                    if not _wait_fd(sock, select.POLLIN, remaining):
                        continue
                    try:
                        chunk = sock.recv(MAX_LINE)
                    except BlockingIOError:
                        continue
                    except OSError:
                        return None
                    if not chunk:
                        return None
                    buf += chunk
            finally:
                if self._enter():  # always true here: this is never a re-entered call
                    try:
                        self._dropped += overloaded
                        if self._sock is sock:
                            self._rbuf = buf + self._rbuf
                    finally:
                        self._leave()
        finally:
            self._rlock.release()

    def _recorded(self, msg):
        msg["ack"] = True
        reply = self._request(msg)
        if reply is None:
            return None
        if reply.get("ok"):
            return reply.get("entry")
        code = reply.get("error")
        if code == "overloaded":  # the daemon dropped it: a drop, not an error
            self._drop()
            return None
        raise MemtrackError(code, reply.get("message", ""), reply)

    # -- the API -----------------------------------------------------------

    def mark(self, component, operation, *, iteration=None, labels=None, ack=False, allocator=True):
        """Record that the job reached ``operation`` of ``component``.

        Fire-and-forget (default): one non-blocking send; returns None.
        ``ack=True``: waits (up to ``timeout``) for the daemon's sample and
        returns the recorded ``detailed_log`` entry, or None when there is no
        daemon or no reply in time; an error reply raises MemtrackError.
        """
        if self._off:
            return None
        if not (component.__class__ is str and operation.__class__ is str):
            _check_name(component, "component")
            _check_name(operation, "operation")
        if "clearml" in _modules:
            _clearml_poll(self)
        if not ack and self._sock is None and _monotonic() < self._retry_at:
            self._drop()  # no daemon: a clock read and a counter
            return None
        msg = {"type": "mark", "component": component, "operation": operation}
        if iteration is not None:
            msg["iteration"] = _check_iteration(iteration)
        if labels:
            msg["labels"] = _check_labels(labels)
        if allocator and "torch" in _modules:
            figures = _allocator_figures()
            if figures is not None:
                msg["allocator"] = figures
        if ack:
            return self._recorded(msg)
        self._send(_line(msg))
        return None

    def _may_send(self):
        """Before a fire-and-forget span/stage message: announce the job's
        ClearML task when the SDK made one, and False (a counted drop)
        while no daemon is there to take it."""
        if "clearml" in _modules:
            _clearml_poll(self)
        if self._sock is None and _monotonic() < self._retry_at:
            self._drop()
            return False
        return True

    def _event(self, kind, fields, allocator=True):
        """A fire-and-forget span/stage message built from checked fields."""
        if self._off or not self._may_send():
            return
        msg = {"type": kind}
        msg.update(fields)
        if allocator and "torch" in _modules:
            figures = _allocator_figures()
            if figures is not None:
                msg["allocator"] = figures
        self._send(_line(msg))

    def _prebuilt(self, head, iteration, kind, fields_of, at, hold):
        """The step hooks' hot path: a span message prebuilt up to its
        iteration (``head``, from :func:`_prebuilt_head`) is finished with
        the iteration and sent, or held back when ``hold`` (steps less than
        :data:`_FAST_NS` apart; it then says when it came, ``at``,
        ``time.time_ns()``), with no dict, no JSON encoding and no check
        repeated. A held step costs an append: the checks (a daemon to send
        to, the job's ClearML task, CUDA) are made when the held steps are
        sent, once the first is :data:`_HOLD_NS` old or :data:`_HOLD_MAX`
        wait. ``_Steps`` holds a fast step's two messages as one record of
        its own instead (see :meth:`_take_held`). A job that uses CUDA takes the general path instead
        (``fields_of(iteration)`` gives its fields), so its allocator
        figures go with the message."""
        if self._off:
            return
        if hold and not self._cuda:
            self._held.append((head, iteration, at))
            # Sent once due (or counted as dropped, with no daemon to take them).
            self._flush_held(at)
            return
        if self._uses_cuda():
            self._event(kind, fields_of(iteration))
            return
        if not self._may_send():
            return
        # Sent at once: stamped and sampled by the daemon as it arrives.
        self._send(b"%s%d}\n" % (head, iteration))

    def _flush_held(self, at):
        """Sends the held step messages once the first is
        :data:`_HOLD_NS` old or :data:`_HOLD_MAX` wait."""
        held = self._held
        try:
            if len(held) < _HOLD_MAX and at - held[0][2] < _HOLD_NS:
                return
        except IndexError:  # taken meanwhile by another thread's send
            return
        self._send_held()

    def _send_held(self):
        """Sends the held step messages (or counts them as dropped, with no
        daemon to take them), after the checks a message makes: CUDA, the
        job's ClearML task."""
        self._uses_cuda()
        if "clearml" in _modules:
            _clearml_poll(self)
        self._send(b"")

    def _uses_cuda(self):
        """Whether the job uses CUDA (once it does, it does for good)."""
        if not self._cuda:
            torch = _modules.get("torch")
            self._cuda = torch is not None and _cuda_in_use(torch)
        return self._cuda

    def span(self, component, operation, *, iteration=None, labels=None):
        """A phase with a duration: context manager and decorator."""
        return Span(component, operation, iteration=iteration, labels=labels, client=self)

    def stage(self, name, *, labels=None):
        """A pipeline stage: context manager and decorator."""
        return Stage(name, labels=labels, client=self)

    def clear_memory(self, component="system"):
        """gc.collect(), torch.cuda.empty_cache() when the job already uses
        CUDA, then a ``clear_memory`` mark. The freeing happens even when the
        client is disabled or has no daemon (the job asked for it; only the
        mark is skipped), so disabling telemetry never changes memory use."""
        gc.collect()
        torch = _modules.get("torch")
        if torch is not None:
            try:
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()
            except Exception:
                pass
        self.mark(component, "clear_memory")

    def report_oom(self, exc=None):
        """Tell memtrack the job hit CUDA out of memory: it records a
        ``cuda/out_of_memory`` entry and keeps its flight recorder's last
        seconds of memory. Sends ``torch.cuda.memory_summary()`` when torch
        already uses CUDA. Waits for the daemon (up to ``timeout``) so the
        report lands before the process dies; returns the entry or None."""
        if self._off:
            return None
        msg = {"type": "oom"}
        if exc is not None:
            msg["message"] = _truncate_utf8(repr(exc), 1024)
        torch = _modules.get("torch")
        if torch is not None:
            try:
                if torch.cuda.is_initialized():
                    msg["summary"] = _truncate_utf8(torch.cuda.memory_summary(), 48 * 1024)
            except Exception:
                pass
        figures = _allocator_figures()
        if figures is not None:
            msg["allocator"] = figures
        try:
            return self._recorded(msg)
        except MemtrackError:
            return None

    def status(self, timeout=None):
        """The daemon's ``status`` reply (a dict), or None without a daemon."""
        reply = self._request({"type": "status"}, timeout)
        if reply is None:
            return None
        if not reply.get("ok"):
            raise MemtrackError(reply.get("error"), reply.get("message", ""), reply)
        return reply

    def cleanup(self, timeout=None):
        """Ask the daemon to push a cleanup notice to every subscriber;
        returns how many were notified, or None without a daemon."""
        reply = self._request({"type": "cleanup"}, timeout)
        if reply is None:
            return None
        if not reply.get("ok"):
            raise MemtrackError(reply.get("error"), reply.get("message", ""), reply)
        return reply.get("notified")

    def dropped(self):
        """Messages dropped in this process: daemon absent, gone, stuck or
        overloaded, and ack requests that got no reply in time."""
        return self._dropped + len(self._reentrant)

    # -- notices -----------------------------------------------------------

    def on_cleanup(self, handler):
        """Run ``handler`` (in the subscriber thread) on every ``cleanup``
        notice. It gets the notice dict if it accepts one argument. Returns
        ``handler``, so this works as a decorator."""
        if not callable(handler):
            raise TypeError("memtrack: the cleanup handler must be callable")
        with self._sub_lock:
            self._cleanup_handlers.append((handler, _accepts_one_argument(handler)))
        self._ensure_listener()
        return handler

    def on_pressure(self, handler):
        """Run ``handler(notice)`` (in the subscriber thread) on every
        ``pressure`` notice. Returns ``handler``."""
        if not callable(handler):
            raise TypeError("memtrack: the pressure handler must be callable")
        with self._sub_lock:
            self._pressure_handlers.append(handler)
        self._ensure_listener()
        return handler

    def enable_auto_cleanup(self, level="critical", *, min_interval=5.0):
        """Run clear_memory() when a pressure notice at ``level`` or above
        arrives, or a cleanup notice; at most once per ``min_interval`` s."""
        if level not in _LEVEL_RANK:
            raise ValueError("memtrack: level must be one of %s" % ", ".join(LEVELS))
        with self._sub_lock:
            self._auto_level = level
            self._auto_min_interval = float(min_interval)
        self._ensure_listener()

    def disable_auto_cleanup(self):
        with self._sub_lock:
            self._auto_level = None

    def wait_subscribed(self, timeout=None):
        """True once the subscriber connection is established (the daemon
        replied ``subscribed``); False after ``timeout`` seconds."""
        return self._subscribed.wait(timeout)

    def _ensure_listener(self):
        if self._off:
            return
        with self._sub_lock:
            if self._listener is not None and self._listener.is_alive():
                return
            self._listen_stop.clear()
            thread = threading.Thread(target=self._listen, name="memtrack-subscriber", daemon=True)
            self._listener = thread
            thread.start()

    def _listen(self):
        """The subscriber thread: its own connection, reconnecting with
        backoff (0.1 s doubling to ``retry_s``) while the daemon is away."""
        stop = self._listen_stop
        backoff = 0.1
        while not stop.is_set():
            sock = None
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listen_sock = sock
                sock.settimeout(max(self.timeout, 0.1))
                sock.connect(self.path)
                _check_owner(sock)
                sock.sendall(_SUBSCRIBE_LINE)
                sock.settimeout(None)
                buf = b""
                while not stop.is_set():
                    chunk = sock.recv(MAX_LINE)
                    if not chunk:
                        break
                    buf += chunk
                    while True:
                        cut = buf.find(b"\n")
                        if cut < 0:
                            break
                        line = buf[:cut]
                        buf = buf[cut + 1 :]
                        try:
                            notice = json.loads(line)
                        except ValueError:
                            continue
                        if isinstance(notice, dict):
                            if notice.get("type") == "subscribed":
                                backoff = 0.1
                            self._dispatch(notice)
            except OSError:
                pass
            finally:
                self._subscribed.clear()
                self._listen_sock = None
                if sock is not None:
                    try:
                        sock.close()
                    except Exception:
                        pass
            if stop.wait(backoff):
                break
            backoff = min(backoff * 2, max(self.retry_s, 0.1))

    def _dispatch(self, notice):
        kind = notice.get("type")
        if kind == "subscribed":
            self._subscribed.set()
            return
        if kind == "cleanup":
            for handler, with_notice in list(self._cleanup_handlers):
                self._call(handler, notice if with_notice else None, with_notice)
            if self._auto_level is not None:
                self._auto_clear()
        elif kind == "pressure":
            for handler in list(self._pressure_handlers):
                self._call(handler, notice, True)
            level = self._auto_level
            if level is not None and _LEVEL_RANK.get(notice.get("level"), -1) >= _LEVEL_RANK[level]:
                self._auto_clear()
        elif notice.get("ok") is False:
            _log.warning("memtrack: the daemon refused the subscription: %s", notice.get("message", notice))

    @staticmethod
    def _call(handler, notice, with_notice):
        try:
            if with_notice:
                handler(notice)
            else:
                handler()
        except Exception:
            _log.exception("memtrack: notice handler %r failed", handler)

    def _auto_clear(self):
        with self._auto_lock:
            now = _monotonic()
            if self._auto_last is not None and now - self._auto_last < self._auto_min_interval:
                return
            self._auto_last = now
        try:
            self.clear_memory()
        except Exception:
            _log.exception("memtrack: automatic clear_memory failed")

    # -- closing -----------------------------------------------------------

    def flush(self, timeout=0.2):
        """Send the step messages held back, and try for up to ``timeout``
        s to finish writing a partly sent message. True when nothing is left
        unsent."""
        deadline = _monotonic() + timeout
        if self._held:
            self._send(b"")
        while True:
            if not self._enter():
                return False
            try:
                sock = self._sock
                if sock is None or not self._pending or self._flush_locked(sock):
                    return True
            finally:
                self._leave()
            remaining = deadline - _monotonic()
            if remaining <= 0:
                return False
            _wait_fd(sock, select.POLLOUT, min(remaining, 0.05))

    def close(self):
        """Flush briefly, close the connections, stop the subscriber."""
        self.flush()
        self._listen_stop.set()
        listen = self._listen_sock
        if listen is not None:
            try:
                listen.shutdown(socket.SHUT_RDWR)  # wakes the subscriber's recv
            except OSError:
                pass
        if self._enter():
            try:
                if self._sock is not None:
                    self._lost_locked(self._sock, None)
                self._retry_at = 0.0
            finally:
                self._leave()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _check_owner(sock):
    """Refuse (``OSError``) a daemon socket served by a uid other than this
    user's, root's or the one ``MEMTRACK_SOCKET_OWNER`` names: a socket in a
    folder others may write to can be swapped for theirs, which would read
    every mark and answer for the daemon. ``SO_PEERCRED`` gives the
    listener's uid, which it cannot forge."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return  # no SO_PEERCRED (not Linux): nothing to check against
    uid = struct.unpack("3i", raw)[1]
    allowed = {os.getuid(), 0}
    owner = os.environ.get("MEMTRACK_SOCKET_OWNER", "").strip()
    if owner.isdigit():
        allowed.add(int(owner))
    if uid not in allowed:
        raise OSError(
            errno.EPERM,
            "the socket is served by uid %d, not by this user or root: not used "
            "(set MEMTRACK_SOCKET_OWNER=%d if that user runs your memtrack)" % (uid, uid),
        )


def _describe(exc):
    if isinstance(exc, OSError) and exc.errno is not None:
        return "%s: %s" % (errno.errorcode.get(exc.errno, exc.errno), exc.strerror)
    return str(exc)


def _is_coroutine_function(func):
    try:
        import inspect

        return inspect.iscoroutinefunction(func)
    except Exception:
        return False


class _Scope:
    """Shared by Span and Stage: context manager and decorator."""

    __slots__ = ()

    def _client(self):
        c = self._owner
        return c if c is not None else get_client()

    def __call__(self, func):
        if _is_coroutine_function(func):

            @functools.wraps(func)
            async def async_wrapper(*args, **kwargs):
                with self:
                    return await func(*args, **kwargs)

            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            with self:
                return func(*args, **kwargs)

        return wrapper


class Span(_Scope):
    """``span_begin`` on entry, ``span_end`` on exit (also on exceptions).
    Timer samples taken in between count for ``component``. Reusable and
    reentrant; holds no state between uses."""

    __slots__ = ("_owner", "_fields")

    def __init__(self, component, operation, *, iteration=None, labels=None, client=None):
        self._owner = client
        self._fields = _fields(component, operation, iteration, labels)

    def __enter__(self):
        # A step that names its batch size gets its own allocator peak
        # (sent with the end mark): batch-fit fits it over the sizes seen.
        if "batch_size" in self._fields.get("labels", ()):
            _reset_step_peak()
        self._client()._event("span_begin", self._fields)
        return self

    def __exit__(self, exc_type, exc, tb):
        self._client()._event("span_end", self._fields)
        return False


class Stage(_Scope):
    """``stage_begin`` on entry; ``stage_end`` with status SUCCESS on a normal
    exit, FAILED with ``message=repr(exc)`` (at most 1024 bytes) when an
    exception leaves the block, which is then re-raised."""

    __slots__ = ("_owner", "_fields")

    def __init__(self, name, *, labels=None, client=None):
        _check_name(name, "stage name")
        self._owner = client
        self._fields = {"name": name}
        if labels:
            self._fields["labels"] = _check_labels(labels)

    def __enter__(self):
        self._client()._event("stage_begin", self._fields)
        return self

    def __exit__(self, exc_type, exc, tb):
        fields = dict(self._fields)
        if exc_type is None:
            fields["status"] = "SUCCESS"
        else:
            fields["status"] = "FAILED"
            try:
                text = repr(exc)
            except Exception:
                text = exc_type.__name__
            fields["message"] = _truncate_utf8(text, MAX_MESSAGE)
        self._client()._event("stage_end", fields)
        return False


# -- the per-process default client ------------------------------------------

_clients = weakref.WeakSet()
_default = None
_default_lock = threading.RLock()


def get_client():
    """This process's default Client (created on first use from the
    environment: MEMTRACK_SOCKET, MEMTRACK_TIMEOUT, MEMTRACK_DISABLE)."""
    global _default
    c = _default
    if c is None:
        with _default_lock:
            c = _default
            if c is None:
                c = _default = Client()
    return c


def _after_fork_in_child():
    global _default, _default_lock, _clearml_lock
    _default_lock = threading.RLock()
    # The announcing thread is not in the child: start over.
    _clearml_lock = threading.Lock()
    _clearml_state.update(next=0.0, retry_at=0.0, task=None, done=None, reply=None)
    _default = None  # the child reads its environment again
    for c in list(_clients):
        c._after_fork_in_child()


# -- the job's own ClearML task ----------------------------------------------
#
# When the job uses the ClearML SDK, memtrack reports into the task the
# script made with Task.init rather than creating one of its own. The client
# sees that task (Task.current_task) on its next message after Task.init and
# tells the daemon once, on a connection of its own, from a background
# thread: the job never waits for it. The daemon answers once it reports
# into the task and has registered the memory_usage artifact there; the
# SDK's close (task.close() and its exit hook) first waits for that answer,
# up to 30 s, so the artifact is on the task before the task is completed.
# When the SDK's close then sets the task's final status, it asks the
# daemon first (``clearml_close``): a daemon that will register the final
# memory_usage file there takes the status over and sets it afterwards (a
# completed task refuses the registration); otherwise, or with no answer,
# the SDK sets it as it would without memtrack.

_clearml_lock = threading.Lock()
_clearml_state = {"next": 0.0, "retry_at": 0.0, "task": None, "done": None, "reply": None,
                  "patched": False, "closing": None, "path": None}


def _clearml_task_id():
    """The id of this process's main ClearML task, or None. Never creates one
    (Task.current_task would initialise a task in a subprocess)."""
    clearml = _modules.get("clearml")
    task_cls = getattr(clearml, "Task", None)
    if task_cls is None:
        return None
    try:
        task = getattr(task_cls, "_Task__main_task", _MISSING)
        if task is _MISSING:
            task = task_cls.current_task()
        tid = getattr(task, "id", None) if task is not None else None
    except Exception:
        return None
    return tid if isinstance(tid, str) and tid else None


def _clearml_poll(client):
    """Called on every message while the SDK is loaded; announces a task it
    has not announced yet. Reading the SDK's main task is one attribute
    lookup; an SDK without it is asked at most once a second, and a failed
    announcement is tried again after the client's retry interval."""
    state = _clearml_state
    main = getattr(getattr(_modules.get("clearml"), "Task", None), "_Task__main_task", _MISSING)
    if main is None:
        return
    if main is _MISSING:
        now = _monotonic()
        if now < state["next"]:
            return
        state["next"] = now + _CLEARML_CHECK_S
        tid = _clearml_task_id()
    else:
        tid = getattr(main, "id", None)
    if tid and tid.__class__ is str and tid != state["task"]:
        if _monotonic() >= state["retry_at"]:
            clearml_announce(tid, client=client)


def clearml_announce(task_id=None, *, client=None, wait=False):
    """Tell the memtrack daemon to report into ClearML task ``task_id``
    (default: the task the job's SDK made with ``Task.init``). Done for you on
    the first mark, span or stage after ``Task.init``; call it yourself to
    announce earlier. With ``wait``, returns the daemon's answer (a dict with
    ``reporting``, ``artifact`` and ``message``), or None without a daemon."""
    if task_id is None:
        task_id = _clearml_task_id()
        if task_id is None:
            return None
    client = client or get_client()
    if client._off:
        return None
    with _clearml_lock:
        state = _clearml_state
        if state["task"] == task_id and state["done"] is not None:
            done = state["done"]
        else:
            done = threading.Event()
            state.update(task=task_id, done=done, reply=None, path=client.path)
            _clearml_hook_close()
            # Registered after Task.init: runs before the SDK's own exit hook.
            atexit.register(_clearml_wait, _CLEARML_TIMEOUT)
            t = threading.Thread(
                target=_clearml_send, args=(client.path, task_id, done),
                name="memtrack-clearml", daemon=True)
            t.start()
    if wait:
        done.wait(_CLEARML_TIMEOUT)
        return _clearml_state["reply"]
    return None


def _clearml_send(path, task_id, done):
    reply = None
    try:
        own = Client(path, timeout=_CLEARML_TIMEOUT)
        try:
            reply = own._request({"type": "clearml_task", "task": task_id, "ack": True})
        finally:
            own.close()
            _clients.discard(own)
        if reply is not None and reply.get("ok") and reply.get("clearml"):
            if reply.get("reporting"):
                _log.info("memtrack: reporting into ClearML task %s", task_id)
            else:
                _log.warning("memtrack: not reporting into ClearML task %s: %s",
                             task_id, reply.get("message", ""))
    except Exception as exc:  # never let the announcement hurt the job
        _log.debug("memtrack: announcing the ClearML task failed: %s", _describe(exc))
    finally:
        _clearml_state["reply"] = reply
        if reply is None:  # no daemon yet (attach starts later): try again
            _clearml_state["retry_at"] = _monotonic() + _RETRY_S
            with _clearml_lock:
                if _clearml_state["task"] == task_id:
                    _clearml_state["task"] = None
        done.set()


def _clearml_wait(timeout=_CLEARML_TIMEOUT):
    done = _clearml_state["done"]
    if done is not None:
        done.wait(timeout)


def _clearml_hook_close():
    """Make the SDK's Task.close wait for the announcement's answer first,
    and offer the daemon the final status its shutdown sets."""
    if _clearml_state["patched"]:
        return
    task_cls = getattr(_modules.get("clearml"), "Task", None)
    original = getattr(task_cls, "close", None)
    if original is None:
        return

    @functools.wraps(original)
    def close(self, *args, **kwargs):
        _clearml_wait()
        return original(self, *args, **kwargs)

    try:
        task_cls.close = close
        _clearml_state["patched"] = True
    except Exception:
        return
    # The SDK's shutdown (task.close() and its exit hook) sets the status
    # with mark_completed, mark_failed or stopped; only those calls, made
    # inside it on the announced task, are offered to the daemon.
    shutdown = getattr(task_cls, "_Task__shutdown", None)
    if shutdown is None:
        return

    @functools.wraps(shutdown)
    def shutting_down(self, *args, **kwargs):
        _clearml_state["closing"] = getattr(self, "id", None)
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            _clearml_state["closing"] = None

    def offered(name, status):
        method = getattr(task_cls, name, None)
        if method is None:
            return None

        @functools.wraps(method)
        def offer(self, *args, **kwargs):
            reason = kwargs.get("status_reason") if status != "completed" else None
            if _clearml_defer_close(getattr(self, "id", None), status, reason):
                return None
            return method(self, *args, **kwargs)
        return offer

    try:
        wrapped = {name: offered(name, status) for name, status in
                   (("mark_completed", "completed"), ("mark_failed", "failed"), ("stopped", "stopped"))}
        if all(wrapped.values()):
            for name, method in wrapped.items():
                setattr(task_cls, name, method)
            task_cls._Task__shutdown = shutting_down
    except Exception:
        pass


def _clearml_defer_close(task_id, status, reason):
    """Inside the SDK's shutdown of the task memtrack reports into: ask the
    daemon to set ``status`` itself after the final artifact. True when it
    took it over (the SDK then leaves the status alone)."""
    state = _clearml_state
    reply = state["reply"]
    if (task_id is None or state["closing"] != task_id or state["task"] != task_id
            or not (reply and reply.get("reporting") and reply.get("artifact"))):
        return False
    msg = {"type": "clearml_close", "task": task_id, "status": status, "ack": True}
    # The protocol takes 1 to 1024 bytes without control characters.
    text = "".join(c if c.isprintable() else " " for c in reason).strip() \
        if isinstance(reason, str) else ""
    if text:
        msg["message"] = text.encode("utf-8")[:1024].decode("utf-8", "ignore")
    try:
        own = Client(state["path"], timeout=_CLEARML_TIMEOUT)
        try:
            answer = own._request(msg)
        finally:
            own.close()
            _clients.discard(own)
    except Exception as exc:  # never let this hurt the job's own close
        _log.debug("memtrack: offering the ClearML task's status failed: %s", _describe(exc))
        return False
    deferred = bool(answer and answer.get("ok") and answer.get("deferred"))
    if deferred:
        _log.info("memtrack: %s", answer.get("message", ""))
    return deferred


def _flush_at_exit():
    for c in list(_clients):
        try:
            if c._held or c._pending:
                c.flush(0.2)
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

atexit.register(_flush_at_exit)


def mark(component, operation, *, iteration=None, labels=None, ack=False, allocator=True):
    """Record a mark with the default client; see Client.mark."""
    c = _default
    if c is None:
        c = get_client()
    return c.mark(component, operation, iteration=iteration, labels=labels, ack=ack, allocator=allocator)


def span(component, operation, *, iteration=None, labels=None):
    """A span on the default client (resolved at entry, so a decorator
    applied before a fork works in the child)."""
    return Span(component, operation, iteration=iteration, labels=labels)


def stage(name, *, labels=None):
    """A stage on the default client; see Stage."""
    return Stage(name, labels=labels)


def clear_memory(component="system"):
    get_client().clear_memory(component)


def on_cleanup(handler):
    return get_client().on_cleanup(handler)


def on_pressure(handler):
    return get_client().on_pressure(handler)


def enable_auto_cleanup(level="critical", *, min_interval=5.0):
    get_client().enable_auto_cleanup(level, min_interval=min_interval)


def wait_subscribed(timeout=None):
    return get_client().wait_subscribed(timeout)


def status(timeout=None):
    return get_client().status(timeout)


def cleanup(timeout=None):
    return get_client().cleanup(timeout)


def dropped():
    return get_client().dropped()


def report_oom(exc=None):
    """Report a CUDA out-of-memory error with the default client; see
    Client.report_oom."""
    return get_client().report_oom(exc)


def _is_cuda_oom(exc):
    """Whether ``exc`` is torch's CUDA out-of-memory error (torch is never
    imported here: only an already-imported torch is consulted)."""
    torch = _modules.get("torch")
    if torch is None:
        return False
    kinds = []
    for owner, name in ((torch, "OutOfMemoryError"), (getattr(torch, "cuda", None), "OutOfMemoryError")):
        kind = getattr(owner, name, None)
        if isinstance(kind, type):
            kinds.append(kind)
    return bool(kinds) and isinstance(exc, tuple(kinds))


class _OomGuard(object):
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and _is_cuda_oom(exc):
            report_oom(exc)
        return False  # re-raise


def oom_guard():
    """Context manager: a CUDA OOM raised inside is reported to memtrack
    (with torch.cuda.memory_summary()) and then re-raised."""
    return _OomGuard()


_oom_hook_installed = False


def _report_uncaught(exc):
    """What the exception hooks do with an uncaught error: a CUDA OOM is
    reported with report_oom (the allocator state, the flight recorder); a
    host MemoryError as a ``host``/``out_of_memory`` mark, waited for."""
    try:
        if _is_cuda_oom(exc):
            report_oom(exc)
        elif isinstance(exc, MemoryError):
            text = _truncate_utf8(repr(exc), 1024)
            get_client().mark("host", "out_of_memory", labels={"error": text}, ack=True)
    except Exception:
        pass


def install_oom_hook():
    """Report an uncaught CUDA out-of-memory error or MemoryError (main
    thread or any thread) to memtrack before Python's usual handling, which
    then runs as before (the previous hooks are chained). memtrack keeps its
    flight recorder's last seconds of memory for a CUDA OOM. Safe to call
    more than once."""
    global _oom_hook_installed
    if _oom_hook_installed:
        return
    _oom_hook_installed = True
    previous = sys.excepthook

    def hook(kind, exc, tb):
        _report_uncaught(exc)
        previous(kind, exc, tb)

    sys.excepthook = hook
    if hasattr(threading, "excepthook"):
        previous_thread = threading.excepthook

        def thread_hook(args):
            _report_uncaught(args.exc_value)
            previous_thread(args)

        threading.excepthook = thread_hook
