#ifndef COUNT_H
#define COUNT_H

#include <stdio.h>

#define MAX_WORD 256

struct stats {
    long lines;
    long words;
    long bytes;
    char longest[MAX_WORD];
};

/* Fill *st from fp; returns 0, or -1 on a read error. */
int count_stream(FILE *fp, struct stats *st);

#endif
