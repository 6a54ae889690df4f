"""The zygotes of nanhunt.cli.serving, driven as re-run verification drives them: prints
what a test checks (each line "name json")."""

import json
import os
import select
import sys

from nanhunt.cli.main import rerun
from nanhunt.cli.serving import zygotes

tmp = sys.argv[1]
r, w = os.pipe()  # a descriptor of the caller's (a terminal, a test harness's pipe)
z1, z2 = zygotes(2, rerun)
os.close(w)
# the zygotes keep nothing of their parent's: with our copy closed, the read end is at EOF
ready, _, _ = select.select([r], [], [], 60)
print("eof", json.dumps(bool(ready) and os.read(r, 1) == b""))
print("ready", json.dumps([json.loads(z.stdout.readline()) for z in (z1, z2)]))
script = os.path.join(tmp, "s.py")
with open(script, "w") as f:
    f.write("import os, sys\nprint('argv', sys.argv[1:], 'cwd', os.getcwd(), "
            "'var', os.environ.get('PROBE'))\nsys.exit(3)\n")
for n, z in enumerate((z1, z2)):
    log = os.path.join(tmp, f"log{n}")
    z.stdin.write(json.dumps({"argv": [script, f"x{n}"], "cwd": tmp, "log": log,
                              "env": dict(os.environ, PROBE=str(n)), "python": True}) + "\n")
    pid = json.loads(z.stdout.readline())["pid"]
    code = json.loads(z.stdout.readline())["code"]
    with open(log) as f:
        print(f"run{n}", json.dumps({"pid": pid != z.pid, "code": code, "out": f.read()}))
z1.close()
z2.stdin.close()  # nanhunt exiting: the pipe closes and the zygote ends by itself
print("exit", json.dumps([z1.returncode, z2.wait(timeout=30)]))
