"""raftkv's own counter (raftkv/examples/counter.py) on a ReplicatedNode, as a program.

    python embedded_counter.py DATA_DIR SECRET_FILE ID ID=HOST:PORT... [--join]

The peers are ``ID=HOST:PORT`` pairs (this node's among them unless ``--join``). It
answers commands read from stdin, one per line, with one JSON line on stdout: ``inc``,
``get``, ``leader``. Used by tests/test_admin.py, which administers it with ``raftkv
admin`` and SIGKILLs it.
"""

import json
import sys

from raftkv.core import RaftError
from raftkv.embedded import ReplicatedNode
from raftkv.examples.counter import Counter
from raftkv.node.errors import NodeError


def main(argv):
    join = "--join" in argv
    argv = [a for a in argv if a != "--join"]
    data_dir, secret_file, me, pairs = argv[0], argv[1], argv[2], argv[3:]
    peers = dict(p.split("=", 1) for p in pairs)
    with open(secret_file, "rb") as f:
        secret = f.read().strip()
    counter = Counter()
    node = ReplicatedNode(counter, me, peers[me], peers, secret, data_dir=data_dir, join=join)
    print(json.dumps({"started": me}), flush=True)
    for line in sys.stdin:
        cmd, *_ = line.split()
        try:
            if cmd == "inc":
                out = counter.incr(timeout=10)
            elif cmd == "get":
                out = counter.get()
            elif cmd == "leader":
                out = node.leader()
            else:
                out = {"unknown": cmd}
        except (RaftError, NodeError, TimeoutError) as e:
            out = {"error": type(e).__name__}
        print(json.dumps({"ok": out}), flush=True)
    node.close()


if __name__ == "__main__":
    main(sys.argv[1:])
