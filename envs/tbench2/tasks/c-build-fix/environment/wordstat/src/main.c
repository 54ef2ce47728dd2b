#include <stdio.h>

#include "count.h"

int main(int argc, char **argv)
{
    FILE *fp;
    struct stats st;

    if (argc != 2) {
        fprintf(stderr, "usage: %s FILE\n", argv[0]);
        return 2;
    }
    fp = fopen(argv[1], "r");
    if (fp == NULL) {
        perror(argv[1]);
        return 1;
    }
    if (count_stream(fp, &st) != 0) {
        perror(argv[1]);
        fclose(fp);
        return 1;
    }
    fclose(fp);
    printf("%ld %ld %ld %s\n", st.lines, st.words, st.bytes, st.longest[0] ? st.longest : "-");
    return 0;
}
