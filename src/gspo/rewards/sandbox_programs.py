"""The two programs behind the `code_tests` sandbox (`gspo.rewards.sandbox`), as source text: the
bootstrap (`BOOT`), which runs as the caller, sets up the containment and execs the harness;
and the harness (`HARNESS`), which runs the model's code and then each test case, and writes one
report line sealed with a MAC. `read_report` finds that line in the program's stdout and checks
it (`mac`)."""

from __future__ import annotations

import hashlib
import hmac

# The bootstrap runs as the caller (maybe root), sets up containment, then execs the harness.
BOOT = r'''
import ctypes, json, os, re, resource as R, signal, sys
C = json.loads(sys.argv[1]); WD = C["wd"]; L = C["lim"]
libc = ctypes.CDLL(None, use_errno=True)
N = {"errors": []}
ROOT = os.geteuid() == 0
UID, GID = (C["uid"], C["uid"]) if ROOT else (os.getuid(), os.getgid())
NEWNS, NEWNET, NEWPID, NEWUSER, NEWIPC = 0x20000, 0x40000000, 0x20000000, 0x10000000, 0x8000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": 1024, "nodiratime": 2048,
        "relatime": 1 << 21, "strictatime": 1 << 24}
def enc(s): return None if s is None else s.encode()
def mount(src, dst, fs, flags, data=None):
    if libc.mount(enc(src), enc(dst), enc(fs), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno(); raise OSError(e, os.strerror(e), dst)
def unshare(f): return libc.unshare(ctypes.c_int(f)) == 0
def put(path, text):
    with open(path, "w") as f: f.write(text)
def blocked(p):  # first directory on the way to p that UID cannot enter (mode bits only)
    d = "/"
    for part in [x for x in os.path.realpath(p).split("/") if x]:
        d = os.path.join(d, part)
        try: st = os.stat(d)
        except OSError: return d
        bit = 0o100 if st.st_uid == UID else 0o010 if st.st_gid == GID else 0o001
        if not st.st_mode & bit: return d
    return None
want = (NEWNS | NEWNET | NEWPID | NEWIPC | (0 if ROOT else NEWUSER)) if C["namespaces"] else 0
got = want if want and unshare(want) else 0
if want and not got: N["errors"].append(f"unshare: {os.strerror(ctypes.get_errno())}")
if not got and ROOT and want:
    for f in (NEWNS, NEWNET, NEWPID, NEWIPC): got |= f if unshare(f) else 0
N.update(netns=bool(got & NEWNET), mountns=bool(got & NEWNS), pidns=bool(got & NEWPID), ipcns=bool(got & NEWIPC),
         userns=bool(got & NEWUSER), tmpfs=False, readonly=False, uid=None, nproc=False)
def seal_userns():  # in a user namespace of the sandbox's own: no nested one (whose capabilities would let the
    # program make PID and mount namespaces: a forked copy passing for the harness, a tmpfs of half the RAM), and
    # inotify counts of its own size (they are charged to the namespace's creator: root's, as the trainer's)
    for k, v in (("max_user_namespaces", 0), ("max_inotify_instances", 16), ("max_inotify_watches", 1024)):
        try: put(f"/proc/sys/user/{k}", str(v))
        except OSError as e: N["errors"].append(f"user.{k}: {e}")
    N["sealed"] = not [e for e in N["errors"] if e.startswith("user.max_user_namespaces")]
if got & NEWUSER:
    put("/proc/self/setgroups", "deny"); put("/proc/self/uid_map", f"{UID} {UID} 1"); put("/proc/self/gid_map", f"{GID} {GID} 1")
    seal_userns()
if got & NEWIPC:  # System V shared memory of its own, gone with the program, and no more of it than memory_mb
    try: put("/proc/sys/kernel/shmmax", str(L["as"])); put("/proc/sys/kernel/shmall", str(L["as"] // os.sysconf("SC_PAGE_SIZE")))
    except OSError as e: N["errors"].append(f"shared memory limit: {e}")
if got & NEWNS:
    try:
        mount(None, "/", None, REC | PRIVATE)
        files = {n: open(os.path.join(WD, n), "rb").read() for n in os.listdir(WD)}
        host = os.open(WD, os.O_RDONLY | os.O_DIRECTORY)
        try:
            mount("gspo", WD, "tmpfs", NOSUID | NODEV, f"size={C['tmpfs_mb']}m,nr_inodes=4096,mode=700,uid={UID},gid={GID}")
            for n, b in files.items():
                with open(os.path.join(WD, n), "wb") as f: f.write(b)
                os.unlink(n, dir_fd=host)  # the host's copy, under the tmpfs: gone, for other runs as for this one
            N["tmpfs"] = True
        except OSError as e:
            N["errors"].append(f"tmpfs workdir: {e}"); mount(WD, WD, None, BIND)  # a mount of its own stays writable
        SHM = None  # POSIX shared memory and semaphores (multiprocessing's locks): a private tmpfs, as small
        if os.path.isdir("/dev/shm"):
            try: mount("gspo", "/dev/shm", "tmpfs", NOSUID | NODEV | NOEXEC, f"size={C['tmpfs_mb']}m,nr_inodes=1024,mode=1777"); SHM = "/dev/shm"
            except OSError as e: N["errors"].append(f"/dev/shm: {e}")
        try:  # let UID reach the interpreter: cover a dir it cannot enter (e.g. /root) with a tmpfs holding only it
            need = [(os.path.realpath(p), blocked(p)) for p in C["need"]] if ROOT else []
            need = [(p, a) for p, a in need if a and a != p and not WD.startswith(a + "/")]
            for i, (p, a) in enumerate(need):
                os.mkdir(os.path.join(C["outer"], f"s{i}")); mount(p, os.path.join(C["outer"], f"s{i}"), None, BIND | REC)
            for a in sorted({a for _, a in need}, key=len):
                if os.path.isdir(a) and blocked(a) == a: mount("gspo", a, "tmpfs", NOSUID | NODEV, "size=64k,mode=755")
            for i, (p, a) in enumerate(need):
                os.makedirs(p, 0o755, exist_ok=True); mount(os.path.join(C["outer"], f"s{i}"), p, None, BIND | REC)
        except OSError as e:
            N["errors"].append(f"exposing the interpreter: {e}")
        bad = []
        for line in open("/proc/self/mountinfo").read().splitlines():
            f = line.split(); mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4])
            if mp in (WD, SHM) or mp == "/proc" or mp.startswith("/proc/"): continue
            try: mount(None, mp, None, REMOUNT | BIND | RDONLY | sum(v for k, v in KEEP.items() if k in f[5].split(",")))
            except OSError: bad.append(mp)
        N["readonly"] = not bad
        if bad: N["errors"].append("could not make read-only: " + " ".join(bad[:5]))
    except OSError as e:
        N["errors"].append(f"mount setup: {e}")
if ROOT and not N["tmpfs"]:  # the program works in the host's folder (root's, 0700, its files 0600): make it its own
    for p in [WD] + [os.path.join(WD, n) for n in os.listdir(WD)]: os.chown(p, UID, GID)
DROP = ROOT and not [p for p in C["need"] if blocked(p)]
def fail(msg): os.write(C["info_fd"], ("FAIL " + msg + "\n").encode()); os._exit(71)
def status(st):
    c = os.waitstatus_to_exitcode(st); return 128 - c if c < 0 else c
def no_unix_sockets():  # seccomp: socket(AF_UNIX, ...) fails with EACCES (a path's socket is reachable through any
    # namespace: the host's daemons, other jobs); socketpair() and pipes, which multiprocessing uses, still work
    import platform
    arch, nr = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}.get(platform.machine(), (None, None))
    if arch is None: N["errors"].append(f"unix sockets: no filter for {platform.machine()}"); return
    F = ctypes.c_ushort, ctypes.c_ubyte, ctypes.c_ubyte, ctypes.c_uint
    class Ins(ctypes.Structure): _fields_ = list(zip(("code", "jt", "jf", "k"), F))
    class Prog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Ins))]
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    code = [(LD, 0, 0, 4), (JEQ, 0, 6, arch), (LD, 0, 0, 0), (JGE, 3, 0, 0x40000000), (JEQ, 0, 3, nr), (LD, 0, 0, 16),
            (JEQ, 0, 1, 1), (RET, 0, 0, 0x00050000 | 13), (RET, 0, 0, 0x7FFF0000)]
    ins = (Ins * len(code))(*[Ins(*c) for c in code])
    prog = Prog(len(code), ins)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        N["errors"].append(f"unix sockets: seccomp: {os.strerror(ctypes.get_errno())}"); return
    N["unix_blocked"] = True
def child(w, r):
    nproc = L["nproc"] + ((2 if got & NEWPID else 1) if got & NEWUSER else 0)  # + bootstrap, init
    if not ROOT and not got & NEWUSER:  # count is per real uid: allow what this user already runs
        for p in [p for p in os.listdir("/proc") if p.isdigit()]:
            try: s = open(f"/proc/{p}/status").read()
            except OSError: continue
            if re.search(r"^Uid:\s+%d\s" % UID, s, re.M): nproc += int(re.search(r"^Threads:\s+(\d+)", s, re.M).group(1))
    for k, v in (("CPU", (L["cpu"], L["cpu"] + 1)), ("AS", (L["as"],) * 2), ("FSIZE", (L["fsize"],) * 2),
                 ("NPROC", (nproc,) * 2), ("NOFILE", (L["nofile"],) * 2), ("CORE", (0, 0))):
        try: R.setrlimit(getattr(R, "RLIMIT_" + k), v)
        except (ValueError, OSError) as e: N["errors"].append(f"RLIMIT_{k}: {e}")
    os.chdir(WD)
    if ROOT and not DROP:
        fail(f"refusing to run model code as root: {C['python']} (or its prefix) is not reachable by uid {UID} "
             f"and cannot be exposed without a mount namespace ({'; '.join(N['errors']) or 'namespaces off or not permitted'}). "
             "Use CodeLimits(python=...) with an interpreter every user can run, or train as a non-root user")
    if not ROOT and not got & NEWUSER and not C["same_user_ok"]:
        why = "; ".join(N["errors"]) if C["namespaces"] else "namespaces off"
        fail(f"refusing to run model code as uid {UID}, the trainer's own, with no user namespace ({why}): it could "
             "signal the trainer and read its environment (/proc/PID/environ). Allow unprivileged user namespaces "
             "(sysctl kernel.unprivileged_userns_clone=1, or kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu), "
             "train as root (the program then runs as uid 65534), plug in an isolated executor "
             "(docs/code_execution.md), or accept this with the code_tests option allow_same_user=true")
    if DROP and C["userns_ok"] and unshare(NEWUSER):  # own user namespace: a per-run process count
        os.write(w, b"u")
        if os.read(r, 1) != b"k": fail("could not write the uid map of the sandbox user namespace")
        N["userns"] = True
        seal_userns()
    else:
        os.write(w, b"-")
    if DROP:
        os.setgroups([]); os.setresgid(GID, GID, GID); os.setresuid(UID, UID, UID)
    N["uid"] = os.getuid(); N["nproc"] = N["uid"] != 0
    N["unix_blocked"] = False
    no_unix_sockets()
    os.write(C["info_fd"], (json.dumps(N) + "\n").encode()); os.set_inheritable(C["info_fd"], False)
    try: os.execve(C["python"], [C["python"], "-I", "-B", "_harness.py"], C["env"])
    except OSError as e: fail(f"cannot start {C['python']}: {e}")
def supervise(userns_ok):
    C["userns_ok"] = userns_ok
    r1, w1 = os.pipe(); r2, w2 = os.pipe()
    b = os.fork()
    if b == 0: os.close(r1); os.close(w2); child(w1, r2)
    os.close(w1); os.close(r2)
    # the wall deadline also holds if our parent dies: kill the group (and so the PID namespace)
    signal.signal(signal.SIGALRM, lambda *a: os.killpg(0, signal.SIGKILL)); signal.alarm(C["alarm"])
    if os.read(r1, 1) == b"u":
        try: put(f"/proc/{b}/uid_map", f"{UID} {UID} 1"); put(f"/proc/{b}/gid_map", f"{GID} {GID} 1"); os.write(w2, b"k")
        except OSError: os.write(w2, b"x")
    while True:
        try: p, st = os.wait()
        except ChildProcessError: os._exit(70)
        if p == b: os._exit(status(st))
if got & NEWPID:
    a = os.fork()
    if a: os._exit(status(os.waitpid(a, 0)[1]))
    proc_ok = False
    if got & NEWNS:
        try: mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC); proc_ok = True
        except OSError as e: N["errors"].append(f"mount /proc: {e}")
    supervise(proc_ok)
supervise(bool(C["namespaces"]))
'''

# The harness runs as the sandboxed program: the code, then each case, then one report line on a
# saved copy of stdout: a marker, a MAC keyed by a secret the program never sees in its source or
# output, and the statuses, hex-encoded. A report the program intercepts (say by pointing that fd
# at a pipe) cannot be altered without the key. Once the program has started, the harness calls
# no Python function and looks up no global or builtin name: everything it uses is a local bound
# before (C functions and builtin types, whose behaviour the program cannot change; a Python
# function's __code__ or __defaults__ it could), and what the report says lives in locals and
# tuples of exact str, nothing gc.get_objects() would hand the program to change. The program
# runs as a module of its own, sys.modules["__main__"] (so pickling its functions by reference,
# as multiprocessing does, finds them), not in the harness's module.
HARNESS = r'''
import hashlib, json, os, sys, types
def _main(write=os.write, getpid=os.getpid, exit=os._exit, compile=compile, exec=exec, isinstance=isinstance,
          type_=type, name_of=type.__dict__["__name__"].__get__, str_=str, BaseExc=BaseException,
          AssertionError_=AssertionError, MemoryError_=MemoryError, OSError_=OSError, SyntaxError_=SyntaxError,
          sha256=hashlib.sha256):
    secret = b""
    while not secret.endswith(b"\n"):
        chunk = os.read(0, 64)
        if not chunk: break
        secret += chunk
    marker, key = secret.split()
    del secret, chunk
    fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0); os.close(fd)
    out, pid = os.dup(1), getpid()
    with open("solution.py", encoding="utf-8", errors="replace") as f: src = f.read()
    with open("tests.json", encoding="utf-8") as f: cases = json.load(f)
    os.remove("tests.json")  # (the program can still learn its tests: docs/code_execution.md)
    jobs = (("solution.py", src),) + tuple([(f"test_{i}", c) for i, c in enumerate(cases)])
    n = len(jobs)
    del cases
    program = types.ModuleType("__main__")
    program.__dict__.update(__builtins__=__builtins__, __file__=os.path.abspath("solution.py"))
    sys.modules["__main__"] = program
    g = program.__dict__
    setup, statuses, msg = None, (), ""
    i = 0
    while i < n:  # (from here on: locals only, and no iterator object that gc could hand the program)
        name, text = jobs[i]
        i += 1
        st, m = None, ""
        try:  # compiled at optimize=0 whatever the interpreter's level, so asserts always run
            exec(compile(text, name, "exec", 0, True, 0), g)
        except BaseExc as e:
            if getpid() != pid: exit(1)
            t = type_(e)
            if isinstance(e, AssertionError_): st = "failed"
            elif isinstance(e, MemoryError_): st = "memory"
            elif isinstance(e, OSError_) and e.errno == 27: st = "file_size"
            elif isinstance(e, SyntaxError_): st = "syntax_error"
            else: st = "error:" + str_.__str__(name_of(t))
            try: m = (f"{name}: {str_.__str__(name_of(t))}: {e}")[:300]
            except BaseExc: m = name + ": " + st
            m = str_.__str__(m)
        if getpid() != pid: exit(0)  # a forked copy of the program must not report
        if name == "solution.py":
            setup, msg = st, m
            if st is not None: break
        else:
            statuses += ("passed" if st is None else st,)
            msg = msg or m
    fields = ("" if setup is None else setup, *statuses, msg)
    payload = "\t".join([f.encode("utf-8", "replace").hex() for f in fields]).encode()
    mac = sha256(key + sha256(key + payload).digest()).hexdigest().encode()
    for s in (sys.stdout, sys.stderr):  # (the program's own objects, maybe: after the report is sealed)
        try: s.flush()
        except BaseExc: pass
    write(out, b"\n" + marker + b" " + mac + b" " + payload + b"\n")
    exit(0)
_main()
'''


def mac(key: bytes, payload: bytes) -> bytes:
    return hashlib.sha256(key + hashlib.sha256(key + payload).digest()).hexdigest().encode()


def read_report(stdout: bytes, marker: str, key: str) -> tuple[dict | None, bytes]:
    """The harness's report (the first line under `marker` whose MAC is valid), and stdout
    without it. Lines under the marker with a wrong MAC (a program's forgeries) stay in stdout."""
    tag, at = marker.encode() + b" ", 0
    while (at := stdout.find(tag, at)) >= 0:
        line = stdout[at:].split(b"\n", 1)[0]
        parts = line.split(b" ")
        if len(parts) == 3 and hmac.compare_digest(parts[1], mac(key.encode(), parts[2])):
            try:
                fields = [bytes.fromhex(f.decode()).decode("utf-8", "replace") for f in parts[2].split(b"\t")]
            except ValueError:
                fields = []
            if len(fields) >= 2:
                rest = stdout[:at].removesuffix(b"\n") + stdout[at + len(line) + 1:]
                return {"setup": fields[0] or None, "cases": fields[1:-1], "msg": fields[-1]}, rest
        at += len(tag)
    return None, stdout
