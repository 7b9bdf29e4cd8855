#!/usr/bin/env bash
# Runs "shellcheck -S warning" over every shell script of the repository: the files git tracks
# (or, in a tree without git, finds) that end in .sh or .sbatch or start with a sh/bash shebang,
# so a new script is checked without being listed anywhere. First a self-test: a script with a
# known fault (a quote closed by a later apostrophe, SC1011) must be reported, else this check
# could not fail. Exit status 0 when every script passes; a reasoned "# shellcheck disable="
# line in a script is the way to accept a warning.
#
#   tests/deploy/shellcheck_all.sh [SHELLCHECK]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
sc="${1:-shellcheck}"

probe="$(mktemp)"
trap 'rm -f "$probe"' EXIT
printf '#!/usr/bin/env bash\nF='"'"'--a\n# the step'"'"'s comment\necho "$F"\n' > "$probe"
if "$sc" -S warning "$probe" > /dev/null 2>&1; then
  echo "shellcheck_all: $sc did not report a known fault; this check would prove nothing" >&2
  exit 1
fi

if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  mapfile -d '' candidates < <(git ls-files -z)
else
  mapfile -d '' candidates < <(find . -path ./.git -prune -o -type f -print0 | sed -z 's|^\./||')
fi
scripts=()
for f in "${candidates[@]}"; do
  [ -f "$f" ] || continue
  case "$f" in
    *.sh|*.sbatch) scripts+=("$f") ;;
    *) head -n1 "$f" 2>/dev/null | grep -qE '^#!.*(/|env )(ba)?sh( |$)' && scripts+=("$f") ;;
  esac
done
if [ ${#scripts[@]} = 0 ]; then
  echo "shellcheck_all: found no shell scripts in $PWD" >&2
  exit 1
fi
echo "shellcheck -S warning over ${#scripts[@]} scripts:"
printf '  %s\n' "${scripts[@]}"
"$sc" -x -S warning "${scripts[@]}"
