#!/bin/bash
set -euo pipefail
cd /app/wordstat

# Recipe lines must start with a tab, and the binary needs both object files.
sed -i 's/^    rm -f wordstat/\trm -f wordstat/' Makefile
sed -i 's/^wordstat: src\/main.o$/wordstat: src\/main.o src\/count.o/' Makefile

# The first of several equally long words wins, so only a strictly longer word replaces it.
sed -i 's/if (len >= strlen(st->longest))/if (len > strlen(st->longest))/' src/count.c

# A word that ends at end of file (no trailing whitespace) must still be counted.
python3 - <<'PY'
from pathlib import Path

path = Path("/app/wordstat/src/count.c")
src = path.read_text()
old = "    }\n    return ferror(fp) ? -1 : 0;\n"
new = """    }
    if (len > 0) {
        st->words++;
        word[len] = '\\0';
        if (len > strlen(st->longest))
            strcpy(st->longest, word);
    }
    return ferror(fp) ? -1 : 0;
"""
assert src.count(old) == 1
path.write_text(src.replace(old, new))
PY

make clean
make
printf 'alpha beta\ngamma' > /tmp/wordstat-check.txt
test "$(./wordstat /tmp/wordstat-check.txt)" = "1 3 16 alpha"
rm -f /tmp/wordstat-check.txt
