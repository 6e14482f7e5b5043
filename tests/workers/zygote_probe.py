"""What tests/test_zygote.py launches. Usage: zygote_probe.py report|orphan|child|fail|hang OUT_DIR"""

import json
import os
import sys
import time

mode, out = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("RANK", os.environ.get("FL_PROBE_RANK", "0")))  # the latter: no launcher
if mode == "report":
    seen = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "FL_PROBE",
                                                "TORCHELASTIC_RUN_ID")}
    import random

    import numpy

    seen.update(argv=sys.argv, cwd=os.getcwd(), preloaded="fabric_learner" in sys.modules, pid=os.getpid(),
                draws=[random.random(), float(numpy.random.rand())])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"rank {rank} reported", flush=True)
elif mode == "orphan" and rank == 1:  # a process the rank leaves behind, in a session of its own
    import subprocess

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
elif mode == "child" and rank == 1:  # two forked processes left behind, untagged, in the rank's session:
    for own_group in (False, True):  # one in the rank's process group (a launcher's killpg ends it), one not
        if (pid := os.fork()) == 0:
            if own_group:
                os.setpgid(0, 0)
            time.sleep(120)
            os._exit(0)
        with open(os.path.join(out, f"child{int(own_group)}.pid"), "w") as f:
            f.write(str(pid))
elif mode == "fail":
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(120)  # what a peer blocked in a collective looks like
elif mode == "hang":
    time.sleep(120)
