"""Start-up errors of the plugin's flags and files, reported the way argparse reports its own.

Every check of the plugin's flags (``--enable-mamba-radix``, ``--warmup-prompts-file``,
``--warmups kda_cache``, ``--max-mamba-cache-size`` under the flag, ``--radix-eviction-policy
recompute``, ``--mamba-spec-state-update``) raises a :class:`FlagError`, a ``ValueError``, so
code that calls SGLang's parser in-process (``prepare_server_args``, ``ServerArgs.resolve_once``)
still catches a ``ValueError`` with the message. SGLang's launchers (``python -m
sglang.launch_server``, ``sglang serve``) catch nothing around ``prepare_server_args`` and
``run_server``: an uncaught error is printed as a 30-40 line traceback, and the interpreter's
shutdown (atexit handlers, non-daemon threads of the imported SGLang modules) can delay the exit.
So the first :class:`FlagError` made in a
process installs a ``sys.excepthook`` (and nothing before it: without the plugin's flags no
hook is installed) that, for a :class:`FlagError` reaching the top of the main thread, writes
what ``argparse.ArgumentParser.error`` writes (a usage line, then ``<prog>: error: <message>``)
to stderr and ends the process at once with status 2 (``os._exit``: no child process exists
yet at argument time, and SGLang's ``finally: kill_process_tree`` has already run). Any other
exception goes to the previous hook unchanged. Mechanism: ``docs/design.md``, "SGLang wiring".
"""

from __future__ import annotations

import os
import sys

#: ``prog`` of SGLang's server parser (``sglang/srt/server_args.py::prepare_server_args``);
#: replaced by the parser's own when :func:`remember_parser` saw it.
_prog = "sglang serve"
_previous_hook = None


class FlagError(ValueError):
    """A bad value or combination of the plugin's flags, or a bad file named by one; the
    message names the flag (and file) and the fix. Making one arms :func:`argparse_excepthook`."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        install_excepthook()


def remember_parser(parser) -> None:
    """Keep the program name of the parser the plugin's flags were added to (for the usage
    line)."""
    global _prog
    _prog = getattr(parser, "prog", None) or _prog


def usage_and_error(message: str) -> str:
    """The two lines written for ``message``: ``usage: <prog> [-h] --model-path MODEL_PATH
    [options]`` and ``<prog>: error: <message>`` (argparse's form, with a one-line usage
    instead of SGLang's ~480-line one; ``--help`` lists every flag)."""
    usage = f"usage: {_prog} [-h] --model-path MODEL_PATH [options] (--help lists them)"
    return f"{usage}\n{_prog}: error: {message}\n"


def argparse_excepthook(exc_type, exc, tb) -> None:
    """``sys.excepthook``: a :class:`FlagError` becomes :func:`usage_and_error` on stderr and
    exit status 2 at once; anything else goes to the previous hook."""
    if not isinstance(exc, FlagError):
        (_previous_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    try:
        sys.stdout.flush()
    except Exception:  # a closed stdout must not hide the message
        pass
    sys.stderr.write(usage_and_error(str(exc)))
    sys.stderr.flush()
    os._exit(2)


def install_excepthook() -> None:
    """Install :func:`argparse_excepthook` once in this process (idempotent)."""
    global _previous_hook
    if sys.excepthook is argparse_excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = argparse_excepthook


#: The plugin's environment switches and their values (docs/flags.md, docs/design.md)
PLUGIN_ENV_CHOICES = {
    "SGLANG_MAMBA_EXT_INCHUNK_IMPL": ("auto", "triton", "torch"),
    "SGLANG_MAMBA_EXT_INCHUNK_FROM_CHUNKS": ("1", "0"),
    "SGLANG_MAMBA_EXT_CPU_KERNELS": ("torch", "triton"),
}


def check_plugin_env() -> None:
    """Refuse, at start-up, a value of the plugin's environment switches other than their
    choices (:data:`PLUGIN_ENV_CHOICES`; unset or empty: the first, the default).

    Raises:
        FlagError: naming the variable, its value and the choices.
    """
    for name, choices in PLUGIN_ENV_CHOICES.items():
        value = os.environ.get(name, "").strip().lower()
        if value and value not in choices:
            raise FlagError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)} "
                            f"(unset: {choices[0]})")
