"""``mjsched dashboard``: the web dashboard's process (:mod:`mjsched_isolated.dashboard.server`)."""

from __future__ import annotations

import argparse
import getpass
import sys

from mjsched_isolated.cli.exits import Exit
from mjsched_isolated.errors import InputError


def cmd_dashboard(args: argparse.Namespace) -> int:
    if args.hash_password:
        from mjsched_isolated.dashboard.auth import hash_secret  # noqa: PLC0415 - loaded only where needed

        password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
        if len(password) < 8:
            raise InputError("password", "must be at least 8 characters long")
        print(hash_secret(password))
        return Exit.OK
    try:
        from mjsched_isolated.dashboard.server import serve  # noqa: PLC0415 - needs the dashboard extra
    except ImportError as exc:
        raise InputError("dashboard", f"the dashboard extra is not installed ({exc.name} is missing): "
                                      "pip install 'mjsched_isolated[dashboard]'") from None
    return serve(args.settings)
