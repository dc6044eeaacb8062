"""The process tests/test_forkserver.py starts: it writes what it sees (its arguments, its working directory, a
variable of its environment, whether torch was imported before it ran, its command line) as one JSON line to its
standard output, then sleeps for its first argument's seconds and exits with its second argument's code ("raise":
an uncaught exception)."""
import json
import os
import sys
import time

import psutil

print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "variable": os.environ.get("FORKSERVER_TEST_VARIABLE"),
                  "torch_imported": "torch" in sys.modules, "cpus": sorted(os.sched_getaffinity(0)),
                  "umask": os.umask(0o022),
                  "command_line": " ".join(psutil.Process().cmdline()).split()}), flush=True)
time.sleep(float(sys.argv[1]))
if sys.argv[2] == "raise":
    raise RuntimeError("the child raised")
sys.exit(int(sys.argv[2]))
