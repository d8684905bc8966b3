"""Operator commands for the engine layer.

    python -m engine check [FILE]   check profiles.yaml (or FILE), print what will run
    python -m engine prepare [FILE] check the profiles, then prepare the model they select
                                    (converts the embedded default model once)
"""

import logging
import sys

from .config import load_config
from .errors import ChatError
from .model import resolve_model


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command in ("check", "prepare"):
            config = load_config(args[0] if args else None)
            for preset in config.used_presets():
                users = ", ".join(p.name for p in config.profiles if p.preset == preset.name)
                runs = (f"remote: {preset.remote.model} at {preset.remote.base_url}"
                        if preset.remote else f"memory share {preset.memory_share:g}")
                print(f"{config.source}: preset {preset.name} ({runs}) <- profiles {users}")
            if command == "prepare":
                print(f"model: {resolve_model(config.model)}")
        else:
            print(__doc__.strip(), file=sys.stderr)
            return 2
    except ChatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
