"""What a forked flow run pays to import its own flow file, after each way the flow-run zygote has preloaded.

    .venv/bin/python bench/flow_file_import.py old|new flows/predict.py

old: the zygote ran the flow file (before issue 34's review, R34-2); new: it imports what the file imports
(forked.preload_flows). Prints one JSON line: the preload's seconds, and the fork's import of the flow file.
"""

import importlib
import json
import os
import runpy
import sys
import time

from resident_pool.prefect.forking import PRELOAD

way, flow = sys.argv[1], os.path.abspath(sys.argv[2])
for name in PRELOAD:
    importlib.import_module(name)
begun = time.perf_counter()
if way == "old":
    sys.path.insert(0, os.path.dirname(flow))
    runpy.run_path(flow, run_name="__resident_pool_preload__")
    sys.path.pop(0)
else:
    from resident_pool.prefect.forked import preload_flows

    preload_flows(json.dumps({"files": [flow], "folders": [os.path.dirname(flow)]}))
preload = time.perf_counter() - begun
pid = os.fork()
if pid == 0:
    begun = time.perf_counter()
    runpy.run_path(flow, run_name="flow")
    seconds = time.perf_counter() - begun
    print(json.dumps({"way": way, "preload_s": round(preload, 3), "fork_import_s": round(seconds, 4)}), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
