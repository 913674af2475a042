"""``python -m sglang_mamba_ext.testing.fork_launch ARGS``: ``python -m sglang.launch_server
ARGS`` with SGLang's scheduler and detokenizer processes forked from the launcher instead of
spawned. Test harness only: what a zygote's child runs (:mod:`.zygote`, for
:class:`sglang_mamba_ext.testing.server.ServerProcess` with ``fork=True``); never what a
user runs.

Why: on the 2-core test machine a server start-up is almost all Python imports — about 20 s in
the launcher and 35 s more in the spawned children, which import SGLang again (the model,
pools and tree take about 1 s; docs/testing.md, "Forked servers"). Forked children inherit the
launcher's imports. SGLang 0.5.23 picks spawn in ``entrypoints/engine.py``
(``multiprocessing.set_start_method("spawn", force=True)``); this wrapper makes that call
pick fork, then runs ``sglang.launch_server`` as ``__main__``, so SGLang's plugin loading and
argument hooks run as in a normal launch.

The environment the plugin's CPU defaults set in the launcher for its children
(``plugin/cpu_defaults.py``) is read by the children when they run, except two variables
read at import, which forked children would see too late: ``TRITON_INTERPRET`` (SGLang's
Triton kernels) and ``TORCHDYNAMO_DISABLE`` (torch). Where the plugin would set them for
this argv, they are set here first, before anything imports torch's or SGLang's kernels (and
the test harness passes them to the zygote, which imports with them); the plugin then finds
them set and does not list them in its "CPU defaults added" line. (A launch zygote also
loads SGLang's plugins, which imports the hook targets' kernel modules: under the zygote's
environment, which holds these two variables.)
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys


def _fork_instead_of_spawn() -> None:
    original = multiprocessing.set_start_method

    def set_start_method(method, force=False):
        original("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = set_start_method


#: Variables of the plugin's CPU defaults that a process reads at import.
IMPORT_TIME_ENV = ("TRITON_INTERPRET", "TORCHDYNAMO_DISABLE")


def import_time_env(argv, environ=None) -> dict:
    """The variables of :data:`IMPORT_TIME_ENV` the plugin's CPU defaults would set for a
    launch with ``argv`` in environment ``environ`` (default ``os.environ``; not modified)
    and that are not set there yet."""
    from sglang_mamba_ext.plugin import cpu_defaults as c

    environ = os.environ if environ is None else environ
    with c.judged_in(environ):
        argv = c.cpu_default_args(argv)[0]
        env = {}
        if c.sglang_kernels_without_cuda(argv):
            env["TRITON_INTERPRET"] = "1"
        if c.speculating_without_cuda(argv):
            env.update(c.cpu_spec_env())
    return {k: v for k, v in env.items() if k in IMPORT_TIME_ENV and k not in environ}


def run(args) -> int:
    """Run ``python -m sglang.launch_server ARGS`` in this process with SGLang's workers
    forked (:func:`_fork_instead_of_spawn`), after setting :func:`import_time_env`.
    Returns 0 when the launcher returns (it exits through ``SystemExit`` otherwise)."""
    preset = import_time_env(args)
    os.environ.update(preset)
    if preset:
        print("[fork_launch] set before import: " + ", ".join(f"{k}={v}" for k, v in preset.items()), flush=True)
    _fork_instead_of_spawn()
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
