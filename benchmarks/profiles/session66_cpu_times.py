"""CPU seconds (user+sys) of a process and each of its descendants: `python3 cpu_times.py PID`."""
import os, sys
tick = os.sysconf("SC_CLK_TCK")
def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    name = s[s.index("(") + 1:s.rindex(")")]
    fields = s[s.rindex(")") + 2:].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            procs[int(p)] = stat(p)
        except (OSError, ValueError):
            pass
root = int(sys.argv[1])
todo, out = [root], []
while todo:
    pid = todo.pop()
    if pid in procs:
        out.append((pid, procs[pid][0], procs[pid][2]))
        todo += [c for c, (_, ppid, _) in procs.items() if ppid == pid]
print(" ".join(f"{pid}:{name}:{cpu:.2f}" for pid, name, cpu in out))
