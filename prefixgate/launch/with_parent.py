"""`python -m prefixgate.launch.with_parent PARENT_PID ARGV...`: run ARGV (exec, same
process) after asking Linux to send it SIGTERM when the process that started it dies
(PR_SET_PDEATHSIG survives exec); exits 0 at once if that parent is already gone.

Why a separate exec instead of `preexec_fn`: a `preexec_fn` makes subprocess fork() rather
than vfork(), and fork() runs gRPC's fork handlers in the child. In a parent that serves or
calls gRPC (a test process, `prefixgate up`, a bench), those handlers restart gRPC's poller
in the child after subprocess closed its file descriptors, and the child aborted
(SIGABRT, "epoll_wait error: Bad file descriptor") before it could exec. Without a
`preexec_fn`, subprocess uses vfork(), which runs no fork handlers.

Imports only launch/processes.py (standard library, no gRPC or torch), so the extra exec
costs one interpreter start (about 70 ms here).
"""

from __future__ import annotations

import os
import sys

from prefixgate.launch.processes import die_with_parent


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: python -m prefixgate.launch.with_parent PARENT_PID ARGV...")
    die_with_parent(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
