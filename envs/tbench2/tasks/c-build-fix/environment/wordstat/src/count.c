#include <ctype.h>
#include <string.h>

#include "count.h"

int count_stream(FILE *fp, struct stats *st)
{
    char word[MAX_WORD];
    size_t len = 0;
    int c;

    memset(st, 0, sizeof *st);
    while ((c = fgetc(fp)) != EOF) {
        st->bytes++;
        if (c == '\n')
            st->lines++;
        if (isspace(c)) {
            if (len > 0) {
                st->words++;
                word[len] = '\0';
                if (len >= strlen(st->longest))
                    strcpy(st->longest, word);
                len = 0;
            }
        } else if (len < MAX_WORD - 1) {
            word[len++] = (char)c;
        }
    }
    return ferror(fp) ? -1 : 0;
}
