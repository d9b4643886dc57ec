"""``dml-optim info``: torch version, each device backend's status, the device we would use,
and the folders of the data installed with the package (model inventories, example descriptors)."""

from __future__ import annotations

import argparse
import json

HELP = "show torch and device-backend status, the device dml-optim would use, and the installed example data"
EXAMPLES = """examples:
  dml-optim info
  dml-optim info --json
"""


def add_parser(sub):
    p = sub.add_parser("info", help=HELP, description=HELP, epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.set_defaults(run=run)
    return p


def gather() -> dict:
    import platform

    import torch

    import dml_optim
    from dml_optim.devices import backend_status, device
    from dml_optim.inventory import builtin_inventories, descriptors_dir, models_dir

    return {
        "dml_optim": dml_optim.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backends": [{"backend": b, "usable": ok, "reason": why} for b, ok, why in backend_status()],
        "device": str(device()),
        "models": {"folder": str(models_dir()), "names": list(builtin_inventories())},
        "example_descriptors": str(descriptors_dir()),
    }


def run(args) -> int:
    info = gather()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"dml-optim {info['dml_optim']}  torch {info['torch']}  python {info['python']}  ({info['platform']})")
    for b in info["backends"]:
        print(f"  {b['backend']:<9} {'usable' if b['usable'] else 'unavailable':<12} {b['reason']}")
    print(f"device: {info['device']}")
    print(f"built-in models: {', '.join(info['models']['names'])} ({info['models']['folder']})")
    print(f"example descriptors: {info['example_descriptors']}")
    return 0
