#!/usr/bin/env bash
# Fresh-machine truth: the README's two commands, as a new user runs them.
#
# A fresh clone of HEAD, an empty venv (no system site-packages), and the two commands extracted from
# README.md now (never a copy of them), each run verbatim by bash from the clone's root in a clean
# environment: only PATH (the venv first, as `activate` sets it), VIRTUAL_ENV, HOME, LANG and this machine's
# PIP_* settings (HOME and PIP_* are the machine's own configuration: on CI's machines they tell pip where the
# local CPU build of torch lies). Nothing is installed into the venv except by those commands. Fails if either command
# fails, if the demo does not print the worked example's output, if anything it prints is a Python
# warning, or if pytest reports a failure or an error.
#
#   bash .ci/fresh_machine.sh            # FRESH_MACHINE_KEEP=1 keeps the scratch folder (logs, venv)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
[ "${FRESH_MACHINE_KEEP:-0}" = 1 ] && echo "scratch folder: $work" || trap 'rm -rf "$work"' EXIT

git clone --quiet --no-hardlinks "$root" "$work/clone"
echo "fresh clone of $(git -C "$work/clone" rev-parse --short HEAD)"

# The fenced bash block under '## The two commands': its command lines, in order.
python3 - "$work/clone/README.md" "$work" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
section = text.split("\n## The two commands", 1)[1].split("\n## ", 1)[0]
block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
if len(commands) != 2:
    sys.exit(f"README.md's '## The two commands' block should hold 2 commands, found {len(commands)}: {commands}")
for i, command in enumerate(commands, 1):
    open(f"{sys.argv[2]}/command{i}.sh", "w").write(command + "\n")
PY

python3 -m venv "$work/venv"
machine_pip_settings=()
while IFS= read -r var; do machine_pip_settings+=("$var"); done < <(env | grep '^PIP_' || true)
run_clean() {  # run_clean N: command N, verbatim, in a clean environment from the clone's root
  local started=$SECONDS rc=0
  echo "command $1: $(cat "$work/command$1.sh")"
  (cd "$work/clone" && env -i PATH="$work/venv/bin:/usr/local/bin:/usr/bin:/bin" VIRTUAL_ENV="$work/venv" \
     HOME="$HOME" LANG=C.UTF-8 "${machine_pip_settings[@]}" bash -e "$work/command$1.sh") \
     > "$work/command$1.log" 2>&1 || rc=$?
  echo "command $1: exit $rc after $((SECONDS - started)) s"
  if [ "$rc" != 0 ]; then failure_reports "$work/command$1.log"; tail -40 "$work/command$1.log"; exit 1; fi
}
failure_reports() {  # pytest's own reports of its failures (tracebacks, assertion messages), if any
  sed -n '/^=\+ \(FAILURES\|ERRORS\) =\+$/,/^=\+ short test summary/p' "$1" | head -400
}

run_clean 1
log1="$work/command1.log"
for expected in "O = W V" "matches the expected O = [[6.15, 3.85], [3.85, 6.15], [5, 5]]: yes" \
                "gradcheck (float64, the fused kernels themselves): passed"; do
  grep -qF "$expected" "$log1" || { echo "the demo did not print: $expected"; tail -40 "$log1"; exit 1; }
done
# pip's own messages are 'WARNING: …'; a Python warning is 'file:line: SomeWarning: …'.
if grep -nE "[A-Za-z]*Warning: " "$log1"; then echo "the demo printed the warnings above"; exit 1; fi
sed -n '/^attention_ext [0-9]/,/^matches the expected O/p' "$log1" | head -12

run_clean 2
summary=$(grep -E "^=+ .*(passed|failed|error).* in [0-9.]+s" "$work/command2.log" | tail -1)
echo "pytest: $summary"
if [ -z "$summary" ] || grep -qE "[0-9]+ (failed|errors?)\b" <<<"$summary"; then
  echo "the test suite did not pass:"; failure_reports "$work/command2.log"
  grep -E "^(FAILED|ERROR)" "$work/command2.log" | head -40; exit 1
fi
echo "fresh machine: both README commands passed"
