#!/usr/bin/env bash
# vm-probe.sh: a diagnostic that boots the microVM guest under QEMU and measures
# the recipe the vm backend implements (docs/vm-recipe.md).
#
# It is research tooling, not product code. It builds a throwaway initramfs
# whose /init is a busybox shell script doing what ign-agent's VM mode will do
# in C (devtmpfs/proc/sys, insmod in modules.order order, /dev/vda read-only,
# tmpfs + overlay, switch_root), followed by a tiny command loop on the
# virtio-serial port named "agent". Then a Python driver (QMP, SCM_RIGHTS)
# measures, for each accelerator that works here (TCG always, KVM if usable:
# /dev/kvm opens, the server's KVM probe finishes in time when the server is
# built, and a test boot answers):
#
#   cold      cold boot to the agent answering (uncompressed vs gzip initramfs)
#   snapshot  warm snapshot: x-ignore-shared, stop, migrate to an fd (getfd)
#   restore   copy-on-write clones (share=off, -incoming defer): fresh QEMU
#             vs a QEMU pre-started and waiting; clone isolation; golden RAM
#             file unchanged
#   memory    PSS/private memory of a clone, idle and after some work, for
#             several -accel tcg,tb-size=N
#   ramsize   guest RAM 128/256/512 MiB: golden boot, clone memory, gcc test
#   stopcont  cont + first round trip of a QMP-stopped clone; idle CPU
#   warm      a golden VM whose page cache was warmed before the snapshot vs
#             a plain one: first python3/gcc run in a clone
#   formats   cold boot and cold guest-side read speed for each image given
#
# usage: image/vm-probe.sh [options]
#   --image PATH          rootfs image (default build/vm/rootfs-tools.erofs);
#                         the guest fs type is detected from its magic
#   --format-image PATH   an image for the formats section (repeatable)
#   --vm DIR              kernel dir from build-kernel.sh (default build/vm)
#   --runs N              repetitions for medians (default 5)
#   --sections LIST       comma-separated subset of the sections above
#                         (default: all of them)
#   --accel LIST          tcg, kvm or tcg,kvm (default: tcg, plus kvm if usable)
#   --mem MIB             guest RAM of the main runs (default 256)
#   --append ARGS         extra kernel command line arguments
#   --keep                keep the work directory (in /tmp) for inspection
#
# Environment: IGN_PROBE_CLONE_RAM_OPTS is appended to the clones'
# memory-backend-file options (e.g. ",readonly=on", which hangs 7.2 clones:
# QEMU 7.2 maps a read-only backend PROT_READ).
#
# Everything it creates lives in one directory under /tmp and RAM files named
# /dev/shm/ign-probe-<pid>-*; both are removed at exit, and every QEMU it
# started is killed, whatever happens.
set -euo pipefail

prog=${0##*/}
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 1; }
say() { printf '==> %s\n' "$*" >&2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)

image=$root/build/vm/rootfs-tools.erofs
vmdir=$root/build/vm
runs=5
sections=cold,snapshot,restore,memory,ramsize,stopcont,warm,formats
accel=
mem=256
append=
keep=
format_images=()
while (($#)); do
	case $1 in
	--image) image=$2; shift 2 ;;
	--format-image) format_images+=("$2"); shift 2 ;;
	--vm) vmdir=$2; shift 2 ;;
	--runs) runs=$2; shift 2 ;;
	--sections) sections=$2; shift 2 ;;
	--accel) accel=$2; shift 2 ;;
	--mem) mem=$2; shift 2 ;;
	--append) append=$2; shift 2 ;;
	--keep) keep=1; shift ;;
	-h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	*) die "unknown option $1 (see --help)" ;;
	esac
done

qemu=$(command -v qemu-system-x86_64) || die "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"
command -v python3 >/dev/null || die "python3 is needed for the QMP driver"
busybox=/bin/busybox
if [[ ! -x $busybox ]] || ldd "$busybox" >/dev/null 2>&1; then
	die "a static $busybox is needed (apt-get install busybox-static)"
fi
[[ -f $vmdir/vmlinux && -f $vmdir/modules/modules.order ]] || die "no kernel in $vmdir: run image/build-kernel.sh $vmdir"
[[ -f $image ]] || die "no rootfs image $image: build it with image/build-rootfs-image.sh build/rootfs/tools $image"
for f in "${format_images[@]}"; do [[ -f $f ]] || die "no image $f"; done

# The host's TSC frequency: microvm under TCG can hang in TSC calibration
# without tsc_early_khz (QEMU-FACTS.md). /proc/cpuinfo's "cpu MHz" is exact
# where the CPU has tsc_known_freq; otherwise take the kernel's calibration.
tsc_khz=$(awk -F: '/^cpu MHz/ { printf "%d\n", $2 * 1000; exit }' /proc/cpuinfo)
if ! grep -qw tsc_known_freq /proc/cpuinfo; then
	k=$(dmesg 2>/dev/null | sed -n 's/.*tsc: Refined TSC clocksource calibration: \([0-9.]*\) MHz.*/\1/p' | tail -n1)
	[[ -n $k ]] && tsc_khz=$(awk -v m="$k" 'BEGIN { printf "%d\n", m * 1000 }')
fi
[[ $tsc_khz =~ ^[0-9]+$ && $tsc_khz -gt 100000 ]] || die "cannot determine the host TSC frequency (got '$tsc_khz')"

work=$(mktemp -d /tmp/ign-probe.XXXXXX)
shm_prefix=/dev/shm/ign-probe-$$
cleanup() {
	local rc=$?
	# The Python driver kills its QEMUs itself; this is the backstop for ours.
	if [[ -f $work/pids ]]; then
		# Only a PID whose command line still names our work directory: a PID
		# from the list may have been reused by now.
		while read -r pid; do
			if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -F "$work/" >/dev/null; then
				kill -9 "$pid" 2>/dev/null || true
			fi
		done <"$work/pids"
	fi
	rm -f "$shm_prefix"-*
	if [[ -n $keep ]]; then
		say "kept $work"
	else
		rm -rf "$work"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the experimental initramfs ---------------------------------------------
say "building the experimental initramfs in $work"
mkdir -p "$work/extra/bin" "$work/extra/probe"
cat >"$work/init" <<'INIT'
#!/bin/busybox sh
# Experimental PID 1 (vm-probe.sh only): what ign-agent's VM mode does, in sh.
bb=/bin/busybox
$bb mount -t devtmpfs devtmpfs /dev
$bb mount -t proc proc /proc
$bb mount -t sysfs sysfs /sys
exec </dev/console >/dev/console 2>&1
read t_init _ </proc/uptime
fstype=erofs
for w in $($bb cat /proc/cmdline); do
	case $w in ign.fstype=*) fstype=${w#*=} ;; esac
done
modtimes=
$bb grep -q ign.modtimes=1 /proc/cmdline && modtimes=1
usec() { $bb adjtimex | $bb awk '/tv_sec/ { s = $2 } /tv_usec/ { print s * 1000000 + $2 }'; }
while read -r m; do
	[ -n "$modtimes" ] && a=$(usec)
	$bb insmod "/lib/modules/$m" || echo "probe-init: insmod $m failed"
	[ -n "$modtimes" ] && echo "$m $(( $(usec) - a ))" >>/modtimes
done </lib/modules/modules.order
read t_mods _ </proc/uptime
$bb mount -t "$fstype" -o ro /dev/vda /mnt/lower || { echo "probe-init: mount /dev/vda ($fstype) failed"; $bb poweroff -f; }
$bb mount -t tmpfs -o mode=0755 tmpfs /mnt/rw
$bb mkdir -p /mnt/rw/upper /mnt/rw/work
$bb mount -t overlay overlay -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work /mnt/root
# The probe's own tools live on a tmpfs at /run/ign of the new root, so
# nothing is added to the image or the overlay.
$bb mount -t tmpfs -o mode=0755 tmpfs /mnt/root/run
$bb mkdir -p /mnt/root/run/ign
$bb cp /bin/busybox /probe/agent.sh /mnt/root/run/ign/
[ -f /modtimes ] && $bb cp /modtimes /mnt/root/run/ign/
read t_mounted _ </proc/uptime
echo "init=$t_init modules=$t_mods mounted=$t_mounted" >/mnt/root/run/ign/times
for d in dev proc sys; do $bb mount --move /$d /mnt/root/$d; done
exec $bb switch_root /mnt/root /run/ign/busybox sh /run/ign/agent.sh
INIT
cat >"$work/extra/probe/agent.sh" <<'AGENT'
# The probe's agent: one command line in, its output and "\n__END__ <rc>\n" out.
bb=/run/ign/busybox
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
# The port's vportNpM name depends on device order: find it by its name.
port=
for d in /sys/class/virtio-ports/*; do
	[ "$($bb cat "$d/name" 2>/dev/null)" = agent ] && port=/dev/${d##*/}
done
[ -n "$port" ] || { echo "probe-agent: no virtio port named agent" >/dev/console; $bb poweroff -f; }
read t _ </proc/uptime
echo "ready=$t port=$port" >>/run/ign/times
exec 3<>"$port"
while :; do
	while IFS= read -r line <&3; do
		eval "$line" >&3 2>&1 </dev/null
		printf '\n__END__ %d\n' $? >&3
	done
	# read() gives EOF while no host is connected: wait, do not spin.
	$bb usleep 20000
done
AGENT
cp "$busybox" "$work/extra/bin/busybox"
chmod 0755 "$work/init" "$work/extra/bin/busybox"
IGN_INITRAMFS_COMPRESS=none "$here/build-initramfs.sh" "$work/init" "$vmdir/modules" "$work/base.cpio" >&2
(cd "$work/extra" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc -R 0:0 --reproducible) >"$work/extra.cpio"
cat "$work/base.cpio" "$work/extra.cpio" >"$work/initrd"
gzip -n -9 <"$work/initrd" >"$work/initrd.gz"
say "initramfs: $(du -h --apparent-size "$work/initrd" | cut -f1) uncompressed, $(du -h --apparent-size "$work/initrd.gz" | cut -f1) gzip"

fi_args=()
for f in "${format_images[@]}"; do fi_args+=(--format-image "$(realpath "$f")"); done

# --- the driver -------------------------------------------------------------
cat >"$work/probe.py" <<'PY'
import argparse, array, json, os, re, signal, socket, statistics, subprocess, sys, time

ap = argparse.ArgumentParser()
ap.add_argument('--qemu'); ap.add_argument('--work'); ap.add_argument('--shm')
ap.add_argument('--kernel'); ap.add_argument('--initrd'); ap.add_argument('--initrd-gz')
ap.add_argument('--image'); ap.add_argument('--format-image', action='append', default=[])
ap.add_argument('--tsc-khz', type=int); ap.add_argument('--runs', type=int)
ap.add_argument('--sections'); ap.add_argument('--accel', default='')
ap.add_argument('--mem', type=int); ap.add_argument('--append', default='')
ap.add_argument('--root')
A = ap.parse_args()
SECTIONS = set(A.sections.split(','))
PIDS = os.path.join(A.work, 'pids')
LIVE = []            # every VM started and not yet reaped

def log(*a):
    print(*a, flush=True)

def ms(x):
    return '%.1f ms' % (x * 1000)

def med(xs):
    return statistics.median(xs) if xs else float('nan')

def summary(xs):
    xs = sorted(xs)
    return 'median %s (min %s, max %s, n=%d)' % (ms(med(xs)), ms(xs[0]), ms(xs[-1]), len(xs))

def fstype_of(path):
    with open(path, 'rb') as f:
        head = f.read(4096)
    if head[1024:1028] == b'\xe2\xe1\xf5\xe0':
        return 'erofs'
    if head[1080:1082] == b'\x53\xef':
        return 'ext4'
    if head[0:4] == b'hsqs':
        return 'squashfs'
    sys.exit('probe: cannot tell the file system type of %s' % path)

class ProbeError(Exception):
    pass

def cmdline(fstype):
    # quiet + tsc_early_khz: see QEMU-FACTS.md. panic=-1 with -no-reboot turns a
    # guest panic into a QEMU exit instead of a hang.
    return ('console=ttyS0 quiet tsc_early_khz=%d nokaslr no_timer_check mitigations=off '
            'i8042.noaux i8042.nokbd i8042.nopnp cryptomgr.notests panic=-1 ign.fstype=%s %s'
            % (A.tsc_khz, fstype, A.append)).strip()

class QMP:
    def __init__(self, sock):
        self.s = sock
        self.buf = b''
        self.events = []
        self.s.settimeout(120)
        greeting = self._msg()
        assert 'QMP' in greeting, greeting
        self.cmd('qmp_capabilities')

    def _msg(self):
        while b'\n' not in self.buf:
            d = self.s.recv(65536)
            if not d:
                raise ProbeError('QMP connection closed')
            self.buf += d
        line, self.buf = self.buf.split(b'\n', 1)
        return json.loads(line)

    def cmd(self, name, fd=None, **args):
        msg = {'execute': name}
        if args:
            msg['arguments'] = args
        data = json.dumps(msg).encode() + b'\n'
        if fd is None:
            self.s.sendall(data)
        else:
            self.s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])
        while True:
            r = self._msg()
            if 'event' in r:
                self.events.append(r)
                continue
            if 'error' in r:
                raise ProbeError('QMP %s: %s' % (name, r['error'].get('desc')))
            return r.get('return')

class Agent:
    END = re.compile(rb'\n__END__ (\d+)\n')

    def __init__(self, sock):
        self.s = sock
        self.buf = b''

    def send(self, line):
        self.s.sendall(line.encode() + b'\n')

    def wait(self, timeout=120):
        self.s.settimeout(timeout)
        while True:
            m = self.END.search(self.buf)
            if m:
                out = self.buf[:m.start()]
                self.buf = self.buf[m.end():]
                return out.decode(errors='replace'), int(m.group(1))
            try:
                d = self.s.recv(65536)
            except socket.timeout:
                raise ProbeError('agent did not answer within %d s' % timeout)
            if not d:
                raise ProbeError('agent connection closed')
            self.buf += d

    def run(self, line, timeout=120):
        self.send(line)
        return self.wait(timeout)

def connect_unix(path, vm, deadline):
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
        vm.check_alive()
        if time.monotonic() > deadline:
            raise ProbeError('%s: %s did not appear' % (vm.name, path))
        time.sleep(0.0005)

class VM:
    seq = 0

    def __init__(self, name, accel='tcg', mem=None, ram=None, share=True, image=None,
                 boot=True, incoming=False, tb=None, initrd=None):
        VM.seq += 1
        self.name = name
        self.dir = os.path.join(A.work, 'vm%d-%s' % (VM.seq, name))
        os.mkdir(self.dir)
        self.accel, self.mem, self.tb = accel, mem or A.mem, tb
        self.ram = ram or '%s-%d-%s.ram' % (A.shm, VM.seq, name)
        self.image = image or A.image
        self.fstype = fstype_of(self.image)
        self.qmp_path = os.path.join(self.dir, 'qmp.sock')
        self.agent_path = os.path.join(self.dir, 'agent.sock')
        self.log_path = os.path.join(self.dir, 'serial.log')
        self.err_path = os.path.join(self.dir, 'qemu.err')
        acc = 'kvm' if accel == 'kvm' else ('tcg' + (',tb-size=%d' % tb if tb else ''))
        # -cpu host passes IA32_ARCH_CAPABILITIES, which nested KVM may refuse.
        cpu = 'host,-arch-capabilities' if accel == 'kvm' else 'qemu64'
        self.argv = [
            A.qemu,
            '-M', 'microvm,x-option-roms=off,isa-serial=on,rtc=on,pic=off,pit=off,memory-backend=mem',
            '-bios', 'qboot.rom',
            '-accel', acc, '-cpu', cpu, '-smp', '1', '-m', '%dM' % self.mem,
            '-object', 'memory-backend-file,id=mem,size=%dM,mem-path=%s,share=%s%s'
                       % (self.mem, self.ram, 'on' if share else 'off',
                          '' if share else os.environ.get('IGN_PROBE_CLONE_RAM_OPTS', '')),
            '-nodefaults', '-no-user-config', '-display', 'none', '-no-reboot',
            '-sandbox', 'on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny',
            '-serial', 'file:' + self.log_path,
            '-qmp', 'unix:%s,server=on,wait=off' % self.qmp_path,
            '-drive', 'file=%s,format=raw,if=none,readonly=on,id=root' % self.image,
            '-device', 'virtio-blk-device,drive=root',
            '-chardev', 'socket,id=agent,path=%s,server=on,wait=off' % self.agent_path,
            '-device', 'virtio-serial-device,id=vser0',
            '-device', 'virtserialport,chardev=agent,name=agent,bus=vser0.0',
            '-object', 'rng-random,id=rng0,filename=/dev/urandom',
            '-device', 'virtio-rng-device,rng=rng0',
        ]
        if boot:
            self.argv += ['-kernel', A.kernel, '-initrd', initrd or A.initrd,
                          '-append', cmdline(self.fstype)]
        if incoming:
            self.argv += ['-incoming', 'defer']
        self.proc = None
        self.qmp = self.agent = None

    def start(self):
        if not self.argv.count('-kernel') and not os.path.exists(self.ram):
            # QEMU would create an empty file and the clone would hang.
            raise ProbeError('golden RAM file %s is missing' % self.ram)
        err = open(self.err_path, 'wb')
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                     close_fds=True)
        err.close()
        LIVE.append(self)
        with open(PIDS, 'a') as f:
            f.write('%d\n' % self.proc.pid)
        return self

    def check_alive(self):
        if self.proc.poll() is not None:
            with open(self.err_path, 'rb') as f:
                err = f.read().decode(errors='replace').strip()
            raise ProbeError('%s: QEMU exited (%s): %s' % (self.name, self.proc.returncode, err[-800:]))

    def connect(self, timeout=30):
        deadline = time.monotonic() + timeout
        self.qmp = QMP(connect_unix(self.qmp_path, self, deadline))
        self.agent = Agent(connect_unix(self.agent_path, self, deadline))
        return self

    def wait_agent(self, timeout=120):
        """Send a ping and wait for the answer (bytes sent before the guest opens
        the port are kept)."""
        self.agent.send('echo pong')
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, rc = self.agent.wait(timeout=1)
                if out.strip() != 'pong':
                    raise ProbeError('%s: unexpected ping answer %r' % (self.name, out))
                return
            except ProbeError as e:
                if 'within' not in str(e):
                    raise
            self.check_alive()
            if time.monotonic() > deadline:
                raise ProbeError('%s: agent did not answer within %d s (serial log: %r; QEMU stderr: %r)'
                                 % (self.name, timeout, self.serial_tail()[-300:], self.err_tail()))

    def serial_tail(self):
        try:
            with open(self.log_path, 'rb') as f:
                return f.read()[-600:].decode(errors='replace')
        except OSError:
            return ''

    def err_tail(self):
        try:
            with open(self.err_path, 'rb') as f:
                return f.read()[-300:].decode(errors='replace').strip()
        except OSError:
            return ''

    def smaps(self):
        r = {}
        with open('/proc/%d/smaps_rollup' % self.proc.pid) as f:
            for line in f:
                p = line.split()
                if len(p) >= 3 and p[2] == 'kB':
                    r[p[0].rstrip(':')] = int(p[1])
        return r

    def top_mappings(self, n=5):
        """The n mappings with the most private memory: (kB, description)."""
        maps, cur = [], None
        with open('/proc/%d/smaps' % self.proc.pid) as f:
            for line in f:
                p = line.split()
                if re.match(r'^[0-9a-f]+-[0-9a-f]+ ', line):
                    lo, hi = (int(x, 16) for x in p[0].split('-'))
                    cur = {'size': (hi - lo) // 1024, 'name': p[5] if len(p) > 5 else '[anon]', 'priv': 0}
                    maps.append(cur)
                elif p[0] in ('Private_Clean:', 'Private_Dirty:'):
                    cur['priv'] += int(p[1])
        maps.sort(key=lambda m: -m['priv'])
        return ['%.1f MB private of a %.0f MB %s' % (m['priv'] / 1024, m['size'] / 1024, m['name'])
                for m in maps[:n]]

    def cpu_seconds(self):
        with open('/proc/%d/stat' % self.proc.pid) as f:
            p = f.read().rsplit(')', 1)[1].split()
        return (int(p[11]) + int(p[12])) / os.sysconf('SC_CLK_TCK')

    def kill(self, remove_ram=False):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()
        for s in (self.qmp and self.qmp.s, self.agent and self.agent.s):
            if s:
                s.close()
        if self in LIVE:
            LIVE.remove(self)
        if remove_ram and os.path.exists(self.ram):
            os.unlink(self.ram)

def cleanup(*_):
    for vm in list(LIVE):
        try:
            vm.kill()
        except Exception:
            pass

def on_signal(sig, frame):
    cleanup()
    sys.exit(128 + sig)

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)

def set_ignore_shared(vm):
    vm.qmp.cmd('migrate-set-capabilities',
               capabilities=[{'capability': 'x-ignore-shared', 'state': True}])

# --- building blocks ---------------------------------------------------------

def cold_boot(name, accel='tcg', mem=None, image=None, initrd=None, timeout=120):
    """Boot a golden VM (RAM file shared); returns (vm, seconds to agent answer)."""
    vm = VM(name, accel=accel, mem=mem, image=image, initrd=initrd)
    t0 = time.monotonic()
    vm.start().connect()
    vm.wait_agent(timeout)
    return vm, time.monotonic() - t0

def guest_times(vm):
    out, _ = vm.agent.run('cat /run/ign/times')
    t = dict(re.findall(r'(\w+)=([^\s]+)', out))
    return {k: float(v) for k, v in t.items() if re.match(r'^[0-9.]+$', v)}, t.get('port')

def snapshot(vm, state_path):
    """x-ignore-shared + stop + migrate to an fd; returns seconds. The host
    stays connected to the agent port (the agent is blocked in read)."""
    t0 = time.monotonic()
    set_ignore_shared(vm)
    vm.qmp.cmd('stop')
    fd = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        vm.qmp.cmd('getfd', fd=fd, fdname='snap')
    finally:
        os.close(fd)
    vm.qmp.cmd('migrate', uri='fd:snap')
    while True:
        st = vm.qmp.cmd('query-migrate').get('status')
        if st == 'completed':
            break
        if st in ('failed', 'cancelled'):
            raise ProbeError('snapshot migration %s' % st)
        time.sleep(0.001)
    return time.monotonic() - t0

def file_kib(path):
    return os.stat(path).st_blocks * 512 // 1024

def prestart_clone(name, golden_ram, mem, accel='tcg', tb=None, image=None):
    """A QEMU waiting in -incoming defer on the golden RAM file (MAP_PRIVATE),
    QMP and agent connected, x-ignore-shared set."""
    vm = VM(name, accel=accel, mem=mem, ram=golden_ram, share=False, boot=False,
            incoming=True, tb=tb, image=image)
    t0 = time.monotonic()
    vm.start().connect()
    set_ignore_shared(vm)
    vm.t_prestart = time.monotonic() - t0
    return vm

def restore(vm, state_path):
    """getfd + migrate-incoming fd: + wait + cont + first answer; returns the
    times of the steps."""
    t = {}
    t0 = time.monotonic()
    fd = os.open(state_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        vm.qmp.cmd('getfd', fd=fd, fdname='snap')
    finally:
        os.close(fd)
    vm.qmp.cmd('migrate-incoming', uri='fd:snap')
    while True:
        st = vm.qmp.cmd('query-status')['status']
        if st != 'inmigrate':
            break
        time.sleep(0.0005)
    if st != 'paused':
        raise ProbeError('%s: after migrate-incoming the VM is %s, not paused (%s)'
                         % (vm.name, st, vm.qmp.cmd('query-migrate')))
    t['loaded'] = time.monotonic() - t0
    vm.qmp.cmd('cont')
    t['cont'] = time.monotonic() - t0
    out, rc = vm.agent.run('echo pong', timeout=30)
    if out.strip() != 'pong':
        raise ProbeError('%s: bad answer after restore: %r' % (vm.name, out))
    t['answer'] = time.monotonic() - t0
    return t

def clone(name, golden_ram, state, mem, accel='tcg', tb=None, image=None):
    t0 = time.monotonic()
    vm = prestart_clone(name, golden_ram, mem, accel, tb, image)
    t = restore(vm, state)
    t['total'] = time.monotonic() - t0
    return vm, t

def make_golden(tag, accel, mem, image=None, warm=None):
    """Cold-boot a golden VM, snapshot it, quit it; returns (ram, state, info)."""
    vm, boot = cold_boot('golden-' + tag, accel=accel, mem=mem, image=image)
    info = {'boot': boot}
    if warm:
        tw = time.monotonic()
        vm.agent.run(warm, timeout=600)
        info['warm'] = time.monotonic() - tw
    state = os.path.join(A.work, 'state-%s' % tag)
    info['snapshot'] = snapshot(vm, state)
    info['state_bytes'] = os.path.getsize(state)
    vm.qmp.cmd('quit')
    vm.proc.wait(timeout=30)
    vm.kill()
    info['ram_kib'] = file_kib(vm.ram)
    return vm.ram, state, info

def mem_line(sm):
    return ('anon %5.1f MB  Pss %5.1f MB (shmem %5.1f, file %5.1f)  Rss %5.1f MB'
            % (sm['Anonymous'] / 1024, sm['Pss'] / 1024, sm.get('Pss_Shmem', 0) / 1024,
               sm.get('Pss_File', 0) / 1024, sm['Rss'] / 1024))

def timed(vm, line, timeout=600):
    t0 = time.monotonic()
    out, rc = vm.agent.run(line, timeout=timeout)
    return time.monotonic() - t0, out, rc

def has(vm, prog):
    return vm.agent.run('command -v %s >/dev/null' % prog)[1] == 0

# --- sections ----------------------------------------------------------------

def kvm_probe():
    """The server's own answer to "does KVM help here" (sandbox/accel.c: a
    long-mode guest at ring 0 counting down a million-iteration loop, given
    100 ms), from `ignition-mcp doctor --json` with the ns backend (so that it
    starts no trial microVM); None when the server is not built."""
    server = os.path.join(A.root, 'build', 'ignition-mcp')
    if not os.access(server, os.X_OK):
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith('IGN_MCP_')}
    env['IGN_MCP_BACKEND'] = 'ns'
    r = subprocess.run([server, 'doctor', '--json'], env=env, capture_output=True, text=True, timeout=60)
    try:
        return json.loads(r.stdout)['accel'].get('kvm_probe')
    except (ValueError, KeyError):
        return None

def kvm_usable():
    if not os.path.exists('/dev/kvm'):
        return False, '/dev/kvm does not exist'
    if not os.access('/dev/kvm', os.R_OK | os.W_OK):
        return False, '/dev/kvm is not read-writable by this user'
    p = kvm_probe()
    if p and 'finished' in p:
        log('KVM probe: %d loop iterations in guest kernel mode: %s (budget %d ms, VM setup %.2f ms)'
            % (p['loops'], '%.2f ms' % p['run_ms'] if p['finished'] else 'not finished', p['budget_ms'], p['setup_ms']))
        if not p['finished']:
            return False, 'the KVM probe did not finish its loop in %d ms: KVM does not help here' % p['budget_ms']
    try:
        vm, t = cold_boot('kvm-check', accel='kvm', timeout=20)
    except ProbeError as e:
        cleanup()
        return False, 'a test boot failed: %s' % str(e).replace('\n', ' | ')[:400]
    vm.kill(remove_ram=True)
    return True, 'test boot to the agent in %s' % ms(t)

def sec_cold(accel):
    log('\n## cold boot to the agent answering (%s, %d MiB, %d runs)' % (accel, A.mem, A.runs))
    log('   time = QEMU spawn -> reply to "echo pong" sent right after connecting')
    for label, initrd in (('uncompressed initramfs', A.initrd), ('gzip initramfs', A.initrd_gz)):
        ts, gt, modt = [], [], {}
        for i in range(A.runs):
            vm, t = cold_boot('cold-%s' % accel, accel=accel, initrd=initrd)
            ts.append(t)
            g, port = guest_times(vm)
            gt.append(g)
            mt, _ = vm.agent.run('cat /run/ign/modtimes 2>/dev/null')
            for line in mt.split('\n'):
                if line.strip():
                    m, us = line.split()
                    modt.setdefault(m, []).append(int(us))
            vm.kill(remove_ram=True)
        log('   %-24s %s' % (label + ':', summary(ts)))
        for k in ('init', 'modules', 'mounted', 'ready'):
            log('       guest uptime at %-8s %.2f s (median)' % (k, med([g[k] for g in gt if k in g])))
        if modt:
            log('       insmod times (median, includes ~2 busybox forks): ' + ', '.join(
                '%s %.1f ms' % (m, med(v) / 1000) for m, v in modt.items()))
    log('   agent port: %s' % port)

def sec_restore(accel, ram, state, ginfo):
    log('\n## warm snapshot (%s)' % accel)
    log('   golden cold boot %s, snapshot (stop + migrate to fd) %s, state file %d bytes, '
        'golden RAM file %.1f MB allocated of %d MiB'
        % (ms(ginfo['boot']), ms(ginfo['snapshot']), ginfo['state_bytes'],
           ginfo['ram_kib'] / 1024, A.mem))
    if 'restore' not in SECTIONS:
        return
    log('\n## restore clones (%s, %d runs)' % (accel, A.runs))
    fresh, pre_start, pre = [], [], []
    steps = {'loaded': [], 'cont': [], 'answer': []}
    for i in range(A.runs):
        vm, t = clone('fresh', ram, state, A.mem, accel)
        fresh.append(t['total'])
        vm.kill()
    for i in range(A.runs):
        vm = prestart_clone('pre', ram, A.mem, accel)
        pre_start.append(vm.t_prestart)
        time.sleep(0.2)   # really waiting
        t = restore(vm, state)
        pre.append(t['answer'])
        for k in steps:
            steps[k].append(t[k])
        vm.kill()
    log('   fresh QEMU (spawn -> answer):              %s' % summary(fresh))
    log('   pre-started QEMU (getfd -> answer):        %s' % summary(pre))
    log('       of which migrate-incoming until paused %s, +cont %s'
        % (ms(med(steps['loaded'])), ms(med(steps['cont']))))
    log('   starting a waiting QEMU (spawn -> QMP ready, caps set): %s' % summary(pre_start))
    vm = prestart_clone('waiting', ram, A.mem, accel)
    c0 = vm.cpu_seconds(); time.sleep(3); c1 = vm.cpu_seconds()
    log('   a QEMU waiting in -incoming defer: %s, CPU %.1f%% of a core'
        % (mem_line(vm.smaps()), (c1 - c0) / 3 * 100))
    vm.kill()
    clones = [clone('many%d' % i, ram, state, A.mem, accel)[0] for i in range(4)]
    time.sleep(2)
    sms = [c.smaps() for c in clones]
    for c in clones:
        c.kill()
    log('   4 idle clones at once: sum of Pss %.1f MB, sum of anon %.1f MB (golden RAM file %.1f MB, '
        'host page cache, counted once)' % (sum(x['Pss'] for x in sms) / 1024,
                                            sum(x['Anonymous'] for x in sms) / 1024, file_kib(ram) / 1024))

    # The host connecting to the agent socket only after cont: the guest's
    # read() sees EOF until then (our sh agent then sleeps 20 ms and retries).
    late = []
    for i in range(A.runs):
        vm = VM('late', accel=accel, mem=A.mem, ram=ram, share=False, boot=False, incoming=True)
        vm.start()
        deadline = time.monotonic() + 30
        vm.qmp = QMP(connect_unix(vm.qmp_path, vm, deadline))
        set_ignore_shared(vm)
        t0 = time.monotonic()
        fd = os.open(state, os.O_RDONLY | os.O_CLOEXEC)
        vm.qmp.cmd('getfd', fd=fd, fdname='snap')
        os.close(fd)
        vm.qmp.cmd('migrate-incoming', uri='fd:snap')
        while vm.qmp.cmd('query-status')['status'] == 'inmigrate':
            time.sleep(0.0005)
        vm.qmp.cmd('cont')
        vm.agent = Agent(connect_unix(vm.agent_path, vm, deadline))
        out, rc = vm.agent.run('echo pong')
        late.append(time.monotonic() - t0)
        vm.kill()
    log('   pre-started, agent socket connected only after cont:  %s' % summary(late))

    # Isolation: two clones at once must not see each other's writes, and the
    # golden RAM file must not change.
    h0 = sha256(ram)
    a, _ = clone('iso-a', ram, state, A.mem, accel)
    b, _ = clone('iso-b', ram, state, A.mem, accel)
    a.agent.run('echo A >/tmp/probe-x; echo A >/etc/probe-x; dd if=/dev/zero of=/tmp/fill bs=1M count=16 2>/dev/null')
    b.agent.run('echo B >/tmp/probe-y')
    ob, _ = b.agent.run('cat /tmp/probe-x /etc/probe-x 2>&1; cat /tmp/probe-y')
    oa, _ = a.agent.run('cat /tmp/probe-x /etc/probe-x; cat /tmp/probe-y 2>&1')
    ra, _ = a.agent.run('head -c 16 /dev/urandom | od -An -tx1')
    rb, _ = b.agent.run('head -c 16 /dev/urandom | od -An -tx1')
    ok = ('No such file' in ob and ob.strip().endswith('B') and oa.startswith('A\nA\n')
          and 'No such file' in oa)
    a.kill(); b.kill()
    h1 = sha256(ram)
    log('   isolation of two concurrent clones: %s' % ('OK (neither sees the other\'s writes)' if ok
                                                       else 'FAILED:\n     A: %r\n     B: %r' % (oa, ob)))
    log('   golden RAM file unchanged after clones wrote: %s' % ('yes' if h0 == h1 else 'NO (changed!)'))
    log('   /dev/urandom in both clones right after restore: %s'
        % ('IDENTICAL (host must reseed)' if ra == rb else 'different'))

def sha256(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for b in iter(lambda: f.read(1 << 20), b''):
            h.update(b)
    return h.hexdigest()

WORK = ('ls -R /usr >/dev/null; python3 -c "import json, email, sqlite3"; '
        'printf "#include <stdio.h>\\nint main(void){puts(\\"hi\\");return 0;}\\n" | gcc -O2 -x c -o /tmp/w - && /tmp/w')

def sec_memory(accel, ram, state):
    log('\n## memory of a clone (%s, %d MiB guest)' % (accel, A.mem))
    log('   idle = 2 s after restore; work = %s' % WORK)
    log('   anon = the clone\'s own memory (QEMU heap, TCG code buffer, guest pages it wrote);')
    log('   Pss also counts the golden RAM file pages it maps (shmem) and QEMU\'s binary (file)')
    tbs = [None, 256, 128, 64, 32, 16] if accel == 'tcg' else [None]
    for tb in tbs:
        vm, t = clone('mem-tb%s' % tb, ram, state, A.mem, accel, tb=tb)
        time.sleep(2)
        idle = vm.smaps()
        if vm.agent.run('command -v gcc >/dev/null && command -v python3 >/dev/null')[1] != 0:
            log('   (the image has no gcc/python3: memory section skipped)')
            vm.kill()
            return
        tw = [timed(vm, WORK)[0] for i in range(3)]
        busy = vm.smaps()
        top = vm.top_mappings(2)
        vm.kill()
        label = 'tb-size=%s' % (tb if tb else 'default')
        log('   %-16s idle:       %s' % (label, mem_line(idle)))
        log('   %-16s after work: %s' % ('', mem_line(busy)))
        log('   %-16s work 1st %s, 2nd %s, 3rd %s; biggest: %s'
            % ('', ms(tw[0]), ms(tw[1]), ms(tw[2]), '; '.join(top)))

def sec_memsizes(accel):
    log('\n## guest RAM size (%s): cold boot, golden file, clone memory, gcc' % accel)
    for mem in (128, 256, 512):
        try:
            ram, state, info = make_golden('mem%d' % mem, accel, mem)
        except ProbeError as e:
            log('   %4d MiB: golden failed: %s' % (mem, e))
            cleanup()
            continue
        vm, t = clone('memsize%d' % mem, ram, state, mem, accel)
        time.sleep(2)
        idle = vm.smaps()
        line = '   %4d MiB: cold boot %s, golden RAM %.1f MB, restore %s, idle clone %s' % (
            mem, ms(info['boot']), info['ram_kib'] / 1024, ms(t['total']), mem_line(idle))
        log(line)
        if has(vm, 'gcc'):
            src = 'printf "#include <stdio.h>\\nint main(void){puts(\\"hi\\");return 0;}\\n" >/tmp/h.c'
            vm.agent.run(src)
            tg, out, rc = timed(vm, 'gcc -O2 -o /tmp/h /tmp/h.c && /tmp/h')
            tg2, out2, rc2 = timed(vm, 'gcc -O2 -o /tmp/h /tmp/h.c && /tmp/h')
            tp, _, rcp = timed(vm, 'python3 -c "import json, sqlite3, email; print(1)"')
            fr, _ = vm.agent.run("free -m | sed -n 2p")
            after = vm.smaps()
            log('             gcc hello: %s (%s), again %s; python3 imports %s (rc %d); guest free: %s'
                % (ms(tg), 'ok' if rc == 0 and out.strip() == 'hi' else 'FAILED rc=%d %r' % (rc, out[-200:]),
                   ms(tg2), ms(tp), rcp, ' '.join(fr.split())))
            log('             clone after gcc: %s' % mem_line(after))
            if mem == 128:
                for d in vm.top_mappings():
                    log('                 %s' % d)
        vm.kill()
        os.unlink(ram)

def sec_stopcont(accel, ram, state):
    log('\n## stopped clones (%s)' % accel)
    vm, _ = clone('stopcont', ram, state, A.mem, accel)
    time.sleep(1)
    c0 = vm.cpu_seconds(); time.sleep(5); c1 = vm.cpu_seconds()
    ts = []
    for i in range(max(A.runs, 10)):
        vm.qmp.cmd('stop')
        time.sleep(0.2)
        t0 = time.monotonic()
        vm.qmp.cmd('cont')
        out, _ = vm.agent.run('echo pong')
        ts.append(time.monotonic() - t0)
    vm.qmp.cmd('stop')
    s0 = vm.cpu_seconds(); time.sleep(5); s1 = vm.cpu_seconds()
    rt = []
    vm.qmp.cmd('cont')
    for i in range(50):
        t0 = time.monotonic(); vm.agent.run(':'); rt.append(time.monotonic() - t0)
    vm.kill()
    log('   cont + first round trip: %s' % summary(ts))
    log('   idle CPU: running %.1f%% of a core, stopped %.1f%%'
        % ((c1 - c0) / 5 * 100, (s1 - s0) / 5 * 100))
    log('   round trip of a no-op command through the sh agent: %s' % summary(rt))

FORMAT_TESTS = (
    ('walk /', 'find / -xdev >/dev/null'),
    ('read python3.11 lib (27 MB, 2k files)', 'find /usr/lib/python3.11 -type f -exec cat {} + >/dev/null'),
    ('read /usr/lib/gcc (79 MB, big files)', 'find /usr/lib/gcc -type f -exec cat {} + >/dev/null'),
    ('python3 -c pass', 'python3 -c pass'),
    ('gcc -c hello.c', 'gcc -c -o /tmp/h.o /tmp/h.c'),
)

def sec_formats(accel):
    log('\n## image formats (%s, %d MiB): cold boot, and reads in the guest' % (accel, A.mem))
    log('   cold = after echo 3 >/proc/sys/vm/drop_caches (median of 3), warm = run again at once;')
    log('   cold - warm is what the file system and the disk cost')
    order = open(os.path.join(os.path.dirname(A.kernel), 'modules', 'modules.order')).read().split()
    for img in A.format_image:
        fs = fstype_of(img)
        if fs != 'ext4' and fs + '.ko' not in order:
            log('   %s: skipped, %s.ko is not in modules.order (IGN_KERNEL_EXTRA_MODULES=%s '
                'image/build-kernel.sh DIR, then --vm DIR)' % (img, fs, fs))
            continue
        boots, mounts = [], []
        nboot = max(1, A.runs // 2)
        for i in range(nboot):
            vm, t = cold_boot('fmt', accel=accel, image=img)
            g, _ = guest_times(vm)
            boots.append(t); mounts.append(g['mounted'] - g['modules'])
            if i + 1 < nboot:
                vm.kill(remove_ram=True)
        log('   %s (%s, %.0f MB): cold boot %s, mount %.2f s guest time' % (
            os.path.basename(img), fs, os.path.getsize(img) / 1e6, ms(med(boots)), med(mounts)))
        vm.agent.run('printf "int main(void){return 0;}\\n" >/tmp/h.c')
        for label, cmd in FORMAT_TESTS:
            if vm.agent.run(cmd)[1] != 0:
                continue
            cold = []
            for i in range(3):
                vm.agent.run('sync; echo 3 >/proc/sys/vm/drop_caches')
                cold.append(timed(vm, cmd)[0])
            warm = timed(vm, cmd)[0]
            log('       %-40s cold %7s  warm %7s  cold-warm %7s'
                % (label, ms(med(cold)), ms(warm), ms(med(cold) - warm)))
        vm.kill(remove_ram=True)

WARM_CMD = ('python3 -c pass; '
            'echo "int main(void){return 0;}" | gcc -x c -c -o /dev/null -')

def sec_warm(accel):
    log('\n## pre-warming the golden VM (%s, %d MiB)' % (accel, A.mem))
    log('   warm = before the snapshot run: %s' % WARM_CMD)
    log('   (this leaves the files those commands read in the golden page cache, shared by all clones)')
    probe = ('python3 -c pass',
             'echo "int main(void){return 0;}" | gcc -x c -c -o /dev/null -')
    for warm in (None, WARM_CMD):
        try:
            ram, state, info = make_golden('warm%d' % bool(warm), accel, A.mem, warm=warm)
        except ProbeError as e:
            log('   golden failed: %s' % e)
            cleanup()
            return
        res = {}
        for i in range(max(3, A.runs // 2)):
            vm, t = clone('warm', ram, state, A.mem, accel)
            if not has(vm, 'gcc'):
                log('   (the image has no gcc/python3: skipped)')
                vm.kill(); os.unlink(ram)
                return
            for cmd in probe:
                for n in ('1st', '2nd'):
                    res.setdefault((cmd, n), []).append(timed(vm, cmd)[0])
            sm = vm.smaps()
            res.setdefault('private', []).append(sm['Anonymous'] / 1024)
            vm.kill()
        log('   %s golden: RAM file %.1f MB%s' % ('warmed' if warm else 'plain', info['ram_kib'] / 1024,
            ', warming took %s' % ms(info['warm']) if warm else ''))
        for cmd in probe:
            log('       %-58s 1st %7s  2nd %7s' % (cmd[:58], ms(med(res[(cmd, '1st')])), ms(med(res[(cmd, '2nd')]))))
        log('       clone anon memory after both: %.1f MB' % med(res['private']))
        os.unlink(ram)

def main():
    accels = [a for a in A.accel.split(',') if a]
    if not accels:
        accels = ['tcg']
        ok, why = kvm_usable()
        log('KVM: %s (%s)' % ('usable' if ok else 'NOT usable', why))
        if ok:
            accels.append('kvm')
    log('accelerators: %s; image %s (%s); kernel command line: %s'
        % (', '.join(accels), A.image, fstype_of(A.image), cmdline(fstype_of(A.image))))
    for accel in accels:
        if 'cold' in SECTIONS:
            sec_cold(accel)
        if SECTIONS & {'snapshot', 'restore', 'memory', 'stopcont'}:
            ram, state, ginfo = make_golden('main-' + accel, accel, A.mem)
            sec_restore(accel, ram, state, ginfo)
            if 'memory' in SECTIONS:
                sec_memory(accel, ram, state)
            if 'stopcont' in SECTIONS:
                sec_stopcont(accel, ram, state)
            os.unlink(ram)
        if 'ramsize' in SECTIONS:
            sec_memsizes(accel)
        if 'warm' in SECTIONS:
            sec_warm(accel)
        if 'formats' in SECTIONS and A.format_image:
            sec_formats(accel)

try:
    main()
except ProbeError as e:
    log('probe: FAILED: %s' % e)
    sys.exit(1)
finally:
    cleanup()
PY

say "running the probe (this takes a few minutes under TCG)"
# In the background, so that a signal to this script is handled at once: it is
# passed on to the driver, which kills its QEMUs, then cleanup() runs.
python3 "$work/probe.py" --qemu "$qemu" --work "$work" --shm "$shm_prefix" \
	--kernel "$(realpath "$vmdir/vmlinux")" --initrd "$work/initrd" --initrd-gz "$work/initrd.gz" \
	--image "$(realpath "$image")" --tsc-khz "$tsc_khz" --runs "$runs" --sections "$sections" \
	--accel "$accel" --mem "$mem" --append "$append" --root "$root" ${fi_args[@]+"${fi_args[@]}"} &
py=$!
trap 'kill -TERM "$py" 2>/dev/null; wait "$py"; exit 130' INT TERM
wait "$py"
