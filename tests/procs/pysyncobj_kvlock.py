"""PySyncObj's README ReplDict + ReplLockManager app, with only its imports changed.

    python pysyncobj_kvlock.py JOURNAL CLIENT_ID AUTO_UNLOCK SELF PARTNER...

Commands on stdin, one JSON answer line each on stdout: ``set KEY VALUE``, ``get KEY``,
``acquire LOCK``, ``release LOCK``, ``check LOCK``, ``leader``. Used by
tests/test_compat_pysyncobj_procs.py, which SIGKILLs it.
"""

import json
import sys

from raftkv.compat.pysyncobj import SyncObj, SyncObjConf, SyncObjException
from raftkv.compat.pysyncobj.batteries import ReplDict, ReplLockManager


def main(argv):
    journal, client, unlock, me, partners = argv[0], argv[1], float(argv[2]), argv[3], argv[4:]
    dict1 = ReplDict()
    lockManager = ReplLockManager(autoUnlockTime=unlock, selfID=client)
    syncObj = SyncObj(me, partners, SyncObjConf(journalFile=journal, password="procs"),
                      consumers=[dict1, lockManager])
    print(json.dumps({"started": me}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "set":
                out = dict1.set(args[0], args[1], sync=True, timeout=10)
            elif cmd == "get":
                out = dict1.get(args[0])
            elif cmd == "acquire":
                out = lockManager.tryAcquire(args[0], sync=True, timeout=10)
            elif cmd == "release":
                out = lockManager.release(args[0], sync=True, timeout=10)
            elif cmd == "check":
                out = lockManager.isAcquired(args[0])
            elif cmd == "leader":
                leader = syncObj._getLeader()
                out = None if leader is None else str(leader)
            else:
                out = {"unknown": cmd}
        except SyncObjException as e:
            out = {"error": e.errorCode}
        print(json.dumps({"ok": out}), flush=True)
    lockManager.destroy()
    syncObj.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
