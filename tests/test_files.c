// File helpers shared by the unit tests (see test_files.h).
#include "test_files.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

void tmp_dir_make(char *dir, size_t len) {
    snprintf(dir, len, "/tmp/moe_test_XXXXXX");
    MOE_CHECK(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
}

void tmp_dir_remove(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        for (struct dirent *e; d && (e = readdir(d));) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char child[PATH_MAX];
            snprintf(child, sizeof child, "%s/%s", path, e->d_name);
            tmp_dir_remove(child);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

const char *tmp_path(char *buf, const char *dir, const char *name) {
    snprintf(buf, PATH_MAX, "%s/%s", dir, name);
    return buf;
}

void write_bytes(const char *path, const void *data, size_t n) {
    FILE *fp = fopen(path, "wb");
    MOE_CHECK(fp && fwrite(data, 1, n, fp) == n && fclose(fp) == 0, "cannot write %s", path);
}

void write_text(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

bool file_exists(const char *path) { return access(path, F_OK) == 0; }

const char *missing_fragment(const char *msg, const char *const *fragments) {
    for (; *fragments; fragments++)
        if (!strstr(msg, *fragments)) return *fragments;
    return NULL;
}
