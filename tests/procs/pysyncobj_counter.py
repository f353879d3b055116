"""PySyncObj's README counter as a program, with only its imports changed.

    python pysyncobj_counter.py JOURNAL SELF PARTNER... [--dynamic]

It answers commands read from stdin, one per line, with one JSON line on stdout:
``inc``, ``add VALUE CN``, ``get``, ``leader``, ``ready``, ``addnode ADDR``,
``removenode ADDR``. Used by tests/test_compat_pysyncobj_procs.py, which SIGKILLs it.
"""

import json
import sys
import threading

from raftkv.compat.pysyncobj import SyncObj, SyncObjConf, SyncObjException, replicated


class MyCounter(SyncObj):
    def __init__(self, selfAddr, partners, conf):
        super(MyCounter, self).__init__(selfAddr, partners, conf)  # noqa: UP008 - as PySyncObj writes it
        self.__counter = 0

    @replicated
    def incCounter(self):
        self.__counter += 1
        return self.__counter

    @replicated
    def addValue(self, value, cn):
        self.__counter += value
        return self.__counter, cn

    def getCounter(self):
        return self.__counter


def membership(change, node):
    done = threading.Event()
    out = []

    def callback(result, error):
        out.append(error)
        done.set()

    change(node, callback=callback)
    done.wait(30)
    return out[0] if out else "no callback"


def main(argv):
    dynamic = "--dynamic" in argv
    argv = [a for a in argv if a != "--dynamic"]
    journal, me, partners = argv[0], argv[1], argv[2:]
    conf = SyncObjConf(journalFile=journal, password="procs", dynamicMembershipChange=dynamic)
    counter = MyCounter(me, partners, conf)
    print(json.dumps({"started": me}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "inc":
                out = counter.incCounter(sync=True, timeout=10)
            elif cmd == "add":
                out = counter.addValue(int(args[0]), int(args[1]), sync=True, timeout=10)
            elif cmd == "get":
                out = counter.getCounter()
            elif cmd == "leader":
                leader = counter._getLeader()
                out = None if leader is None else str(leader)
            elif cmd == "ready":
                out = counter.isReady()
            elif cmd == "addnode":
                out = membership(counter.addNodeToCluster, args[0])
            elif cmd == "removenode":
                out = membership(counter.removeNodeFromCluster, args[0])
            else:
                out = {"unknown": cmd}
        except SyncObjException as e:
            out = {"error": e.errorCode}
        print(json.dumps({"ok": out}), flush=True)
    counter.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
