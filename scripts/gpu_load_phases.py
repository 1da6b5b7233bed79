"""Where an artifact's load spends its seconds: one fresh process, the phases of portlayer.load +
executable() timed after the imports, the main thread profiled (issue 20; docs/performance.md, session 9).

    python scripts/gpu_load_phases.py ART phases     # the default load: hash check beside the copy
    python scripts/gpu_load_phases.py ART blocking   # every chunk hashed first (PORTLAYER_VERIFY_WAIT's order)
    python scripts/gpu_load_phases.py ART hashonly   # the blocking hash check alone
    PORTLAYER_HASH_THREADS=4 python scripts/gpu_load_phases.py ART phases

Prints one line "LOADDIAG {json}": seconds since the start of the load at the end of each phase.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

T_START = time.perf_counter()


def main(art: str, mode: str) -> dict:
    import torch

    from portlayer.capabilities.probe import probe_devices
    from portlayer.runtime import artifact as A
    from portlayer.runtime import loaded as L

    out: dict = {"mode": mode, "hash_threads": os.environ.get("PORTLAYER_HASH_THREADS", "default"),
                 "upload_threads": os.environ.get("PORTLAYER_UPLOAD_THREADS", "default"),
                 "import_s": round(time.perf_counter() - T_START, 3)}
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()

    def lap(name: str) -> None:
        out[name] = round(time.perf_counter() - t0, 3)

    if mode == "hashonly":
        A.verify_artifact(art, wait=True)
        lap("verify_blocking")
    else:
        m = A.verify_artifact(art, wait=(mode == "blocking"))
        lap("verify_small")
        probe_devices()
        lap("probe")
        la = L._open_verified(m, True, False, False)
        lap("opened")
        la._mapped_graph  # noqa: B018 - the phase: graph and weights mapped
        lap("mapped_graph")
        la._executable()
        lap("program")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        lap("sync")
        la.join_verification()
        lap("joined")
        if m.pending is not None and m.pending.check.finished:
            out["hash_done_at"] = round(m.pending.check.finished - t0, 3)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(28)
    out["profile"] = s.getvalue()[-6000:]
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("phases", "blocking", "hashonly"):
        sys.exit(__doc__)
    print("LOADDIAG " + json.dumps(main(sys.argv[1], sys.argv[2])))
