"""``python -m worker.probe``: which devices the installed engine build can use.

Printed as one JSON object. The parent runs this in a subprocess (it never
imports the engine itself) to tell a CPU-only engine build on a GPU machine.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import xllamacpp

    devices = xllamacpp.get_device_info()
    gpus = [d for d in devices if d["type"] != xllamacpp.ggml_backend_dev_type.GGML_BACKEND_DEVICE_TYPE_CPU]
    print(json.dumps({"gpu_devices": [str(d["name"]) for d in gpus],
                      "version": str(getattr(xllamacpp, "__version__", ""))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
