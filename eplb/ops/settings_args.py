"""argparse for EplbConfig settings, shared by `eplb` (eplb/ops/cli.py) and the demo job
(eplb/ops/demo_args.py): a setting's flag is its field name with dashes (`Setting`); old
spellings still parse with a one-line deprecation warning and are hidden from --help and
from error messages (`SettingsParser`)."""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys


class Setting(argparse.Action):
    """An option for an EplbConfig setting: its first option string is the canonical flag
    (the field name with dashes, e.g. --window-size); any further ones are deprecated
    aliases (old spellings such as --window) that still parse, print a one-line warning to
    stderr, and are hidden from --help. `nargs=0` with `const` makes it a switch
    (store_true with const=True, default False)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None and option_string != self.option_strings[0]:
            warn_deprecated(parser.prog, option_string, self.option_strings[0])
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def on_off(value: str) -> bool:
    """argparse type of an on/off setting (`--drift-trend on|off`): "on" -> True, "off" -> False."""
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def warn_deprecated(prog: str, old: str, new: str) -> None:
    """The one-line deprecation warning of an old flag spelling (once per job: under
    torchrun only rank 0 prints it)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{prog}: warning: {old} is deprecated, use {new}", file=sys.stderr, flush=True)


def deprecated_aliases(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{old spelling: canonical flag} of every Setting of `parser`."""
    return {old: a.option_strings[0] for a in parser._actions if isinstance(a, Setting)
            for old in a.option_strings[1:]}


def canonical_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with the deprecated spellings of `parser`'s options (`--old V`, `--old=V`)
    replaced by their canonical flags, for forwarding to another parser without a second
    warning."""
    aliases = deprecated_aliases(parser)
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(aliases[name] + eq + value if name in aliases else arg)
    return out


class SettingsHelpFormatter(argparse.HelpFormatter):
    """--help lists a Setting under its canonical flag only."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Setting) and len(action.option_strings) > 1:
            action = copy.copy(action)
            action.option_strings = action.option_strings[:1]
        return super()._format_action_invocation(action)


_ALIASES_IN_ERROR = re.compile(r"^argument (--[\w-]+)(?:/--[\w-]+)+:")


class SettingsParser(argparse.ArgumentParser):
    """argparse that shows Settings by their canonical flag, in --help and in errors."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", SettingsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        super().error(_ALIASES_IN_ERROR.sub(r"argument \1:", message))
