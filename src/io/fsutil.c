// Crash-safe file-system helpers (see fsutil.h).
#include "fsutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

int fs_mkdir_p(const char *path, MoeErr err) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return moe_err(err, "%s: path too long", path);
    for (char *p = buf + 1;; p++) {
        bool end = *p == 0;
        if (*p == '/' || end) {
            *p = 0;
            if (mkdir(buf, 0777) && errno != EEXIST)
                return moe_err(err, "%s: cannot create directory (%s)", buf, strerror(errno));
            if (!fs_is_dir(buf)) return moe_err(err, "%s: exists and is not a directory", buf);
            if (end) break;
            *p = '/';
        }
    }
    return 0;
}

int fs_fsync_dir(const char *path, MoeErr err) {
    int fd = open(path, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return moe_err(err, "%s: cannot open directory (%s)", path, strerror(errno));
    int rc = fsync(fd);
    int saved = errno;
    close(fd);
    if (rc && saved != EINVAL) return moe_err(err, "%s: fsync failed (%s)", path, strerror(saved));
    return 0;
}

int fs_remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st)) return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(st.st_mode)) return unlink(path);
    DIR *d = opendir(path);
    if (!d) return -1;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        rc |= fs_remove_tree(child);
    }
    closedir(d);
    return rc | rmdir(path);
}

bool fs_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

bool fs_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

const char *fs_split(const char *path, char *dir, size_t len) {
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, len, ".");
    else if (slash == path) snprintf(dir, len, "/");
    else snprintf(dir, len, "%.*s", (int)(slash - path), path);
    return slash ? slash + 1 : path;
}

static bool fs_same_inode(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

bool fs_same_file(const char *a, const char *b) {
    if (fs_exists(a) || fs_exists(b)) return fs_same_inode(a, b);
    char dir_a[4096], dir_b[4096];
    const char *name_a = fs_split(a, dir_a, sizeof dir_a), *name_b = fs_split(b, dir_b, sizeof dir_b);
    return !strcmp(name_a, name_b) && fs_same_inode(dir_a, dir_b);
}

static int fs_lock_held(int fd, const char *dir, MoeErr err) {
    char holder[128] = "";
    ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
    holder[n > 0 ? n : 0] = 0;
    holder[strcspn(holder, "\n")] = 0;
    close(fd);
    return moe_err(err, "%s is in use by another moe train (%s%s); wait for it to end or choose "
                   "another train.out", dir, holder[0] ? "pid " : "its pid is not written yet",
                   holder);
}

int fs_lock_dir(const char *dir, MoeErr err) {
    char path[4200], me[128], host[64] = "?";
    if (fs_mkdir_p(dir, err)) return -1;
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return moe_err(err, "%s: cannot open the run lock (%s)", path, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB)) {
        if (errno == EWOULDBLOCK) return fs_lock_held(fd, dir, err);
        int saved = errno;
        close(fd);
        return moe_err(err, "%s: cannot lock (%s)", path, strerror(saved));
    }
    gethostname(host, sizeof host - 1);
    int len = snprintf(me, sizeof me, "%ld on %s\n", (long)getpid(), host);
    if (ftruncate(fd, 0) || pwrite(fd, me, (size_t)len, 0) != len) {
        int saved = errno;
        close(fd);
        return moe_err(err, "%s: cannot write the run lock (%s)", path, strerror(saved));
    }
    return fd;
}

static const char *fs_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    if (S_ISSOCK(mode)) return "a socket";
    return "a special file";
}

int fs_open_regular(const char *path, const char *what, MoeErr err) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return moe_err(err, "%s: cannot open %s: %s", path, what, strerror(errno));
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st)) rc = moe_err(err, "%s: cannot stat %s: %s", path, what, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = moe_err(err, "%s: the %s is %s, not a regular file", path, what, fs_kind(st.st_mode));
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK))
        rc = moe_err(err, "%s: cannot open %s: %s", path, what, strerror(errno));
    if (rc) close(fd);
    return rc ? -1 : fd;
}

FILE *fs_fopen_regular(const char *path, const char *what, MoeErr err) {
    int fd = fs_open_regular(path, what, err);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "rb");
    if (fd >= 0 && !f) {
        moe_err(err, "%s: cannot open %s: %s", path, what, strerror(errno));
        close(fd);
    }
    return f;
}

int fs_read_file(const char *path, const char *what, uint8_t **data, size_t *len, MoeErr err) {
    FILE *f = fs_fopen_regular(path, what, err);
    if (!f) return -1;
    struct stat st;
    size_t cap = fstat(fileno(f), &st) == 0 && st.st_size > 0 ? (size_t)st.st_size + 1 : 4096, n = 0;
    uint8_t *buf = moe_malloc(cap);
    for (;;) { // to the end of the file, whatever its size said
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        cap *= 2;
        buf = moe_realloc(buf, cap);
    }
    int rc = ferror(f) ? moe_err(err, "%s: cannot read %s: %s", path, what, strerror(errno)) : 0;
    fclose(f);
    if (rc) {
        free(buf);
        return -1;
    }
    buf = moe_realloc(buf, n + 1);
    buf[n] = 0;
    *data = buf;
    *len = n;
    return 0;
}

json_t *fs_parse_json(const char *path, const char *text, size_t len, MoeErr err) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) moe_err(err, "%s:%d:%d: malformed JSON: %s", path, jerr.line, jerr.column, jerr.text);
    return root;
}

json_t *fs_load_json(const char *path, const char *what, MoeErr err) {
    uint8_t *text;
    size_t len;
    if (fs_read_file(path, what, &text, &len, err)) return NULL;
    json_t *root = fs_parse_json(path, (const char *)text, len, err);
    free(text);
    return root;
}

bool fs_dir_empty(const char *path) {
    DIR *d = opendir(path);
    if (!d) return false;
    struct dirent *e;
    bool empty = true;
    while (empty && (e = readdir(d))) empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    closedir(d);
    return empty;
}

int fs_copy_file(const char *src, const char *dst, const char *what, MoeErr err) {
    FILE *in = fs_fopen_regular(src, what, err);
    if (!in) return -1;
    FILE *out = fopen(dst, "wb");
    if (!out) {
        fclose(in);
        return moe_err(err, "%s: cannot create (%s)", dst, strerror(errno));
    }
    char buf[65536];
    size_t n;
    bool bad = false;
    while (!bad && (n = fread(buf, 1, sizeof buf, in)) > 0) bad = fwrite(buf, 1, n, out) != n;
    bad |= ferror(in) != 0;
    bad |= fflush(out) != 0 || fsync(fileno(out)) != 0;
    int saved = errno;
    bad |= fclose(out) != 0;
    fclose(in);
    if (bad) unlink(dst);
    return bad ? moe_err(err, "%s: cannot copy %s to %s (%s)", src, what, dst, strerror(saved)) : 0;
}

int fs_replace_dir(const char *tmp, const char *final, const char *old, MoeErr err) {
    if (fs_exists(final) && rename(final, old))
        return moe_err(err, "%s: cannot replace (%s)", final, strerror(errno));
    if (rename(tmp, final)) return moe_err(err, "%s: cannot rename into place (%s)", final, strerror(errno));
    fs_remove_tree(old);
    char parent[4096];
    fs_split(final, parent, sizeof parent);
    return fs_fsync_dir(parent, err);
}

int fs_write_json_synced(const char *path, json_t *root, MoeErr err) {
    FILE *f = fopen(path, "w");
    if (!f) return moe_err(err, "%s: cannot write (%s)", path, strerror(errno));
    int bad = json_dumpf(root, f, JSON_INDENT(2) | JSON_REAL_PRECISION(17)) || fputc('\n', f) == EOF;
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    int saved = errno;
    bad |= fclose(f) != 0;
    if (bad) {
        unlink(path);
        return moe_err(err, "%s: write failed (%s%s)", path, strerror(saved ? saved : errno),
                       saved == ENOSPC ? ": disk full?" : "");
    }
    return 0;
}

int fs_write_json_atomic(const char *path, json_t *root, MoeErr err) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (fs_write_json_synced(tmp, root, err)) return -1;
    if (rename(tmp, path)) {
        int saved = errno;
        unlink(tmp);
        return moe_err(err, "%s: cannot rename into place (%s)", path, strerror(saved));
    }
    return 0;
}
