#!/usr/bin/env bash
# Checks that every repository file the documentation, a source comment or a help text cites
# exists, so a moved or deleted file leaves no stale pointer. Read: the markdown files at the top
# and in docs/, the Makefile, and the C, CUDA and shell files in src, tests, bench and scripts
# (whole text). A citation is
#   - a path: one of the top folders src docs scripts tests configs bench, a slash, then letters,
#     digits and _ . - / * (a final . or / is punctuation, not part of it); it must name an
#     existing file or folder, or with * match at least one;
#   - a markdown file name without a folder: letters, digits, _ and -, then ".md", where the
#     character before is none of those nor . / $; some file of the repository must have that name.
# Not citations: build outputs (*.o) and the stems of make patterns or variables (followed by % or $).
# Prints file:line and the citation for each that is broken, and ends with "N passed, N failed"
# (citations).
set -u
cd "$(dirname "$0")/.."

CITATION='(^|[^A-Za-z0-9_./$-])((src|docs|scripts|tests|configs|bench)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*]|[A-Za-z0-9_-]+\.md)[%$]?'
md_names=" $(find . -path ./build -prune -o -name '*.md' -print | sed 's|.*/||' | tr '\n' ' ') "
pass=0
fail=0

cited_exists() {
    case "$1" in
    */*) compgen -G "$1" >/dev/null ;;
    *) [[ "$md_names" == *" $1 "* ]] ;;
    esac
}

files=$(ls ./*.md docs/*.md Makefile; find src tests bench scripts -type f \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' \))
for f in $files; do
    while IFS=: read -r line match; do
        cited=$(sed -E 's/^[^A-Za-z0-9_]//' <<<"$match")
        case "$cited" in *% | *\$ | *.o) continue ;; esac
        if cited_exists "$cited"; then
            pass=$((pass + 1))
        else
            echo "${f#./}:$line: cites $cited, which is not in the repository"
            fail=$((fail + 1))
        fi
    done < <(grep -noE "$CITATION" "$f")
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
