"""memtrack's Python client: tell the memtrack daemon what the job is doing.

    import memtrack

    memtrack.mark("model", "before_generate", iteration=step)
    with memtrack.span("model", "generate"):
        out = model.generate(batch)
    with memtrack.stage("train_small"):
        train()

Standard library only; never imports torch. Without a daemon (no
``MEMTRACK_SOCKET``, or nothing listening there) every call is a cheap
no-op that never blocks the job. See README.md and docs/protocol.md.
"""

from .client import (
    LEVELS,
    MAX_LINE,
    Client,
    MemtrackError,
    MemtrackWarning,
    Span,
    Stage,
    cleanup,
    clear_memory,
    clearml_announce,
    get_client,
    dropped,
    enable_auto_cleanup,
    install_oom_hook,
    mark,
    on_cleanup,
    on_pressure,
    oom_guard,
    report_oom,
    span,
    stage,
    status,
    wait_subscribed,
)

__version__ = "0.1.0"
#: The protocol version this client speaks.
PROTOCOL_VERSION = 1

__all__ = [
    "Client",
    "LEVELS",
    "MAX_LINE",
    "MemtrackError",
    "MemtrackWarning",
    "PROTOCOL_VERSION",
    "Span",
    "Stage",
    "cleanup",
    "clear_memory",
    "clearml_announce",
    "get_client",
    "dropped",
    "enable_auto_cleanup",
    "install_oom_hook",
    "mark",
    "on_cleanup",
    "on_pressure",
    "oom_guard",
    "report_oom",
    "span",
    "stage",
    "status",
    "wait_subscribed",
]
