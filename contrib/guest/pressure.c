/*
 * vzram-pressure: memory-pressure and raw-disk pattern tool for the vzram
 * test guest.  Static, no dependencies beyond libc.
 *
 * Every 4 KiB page is a pure function of (seed, round, page index), so any
 * page can be regenerated and compared byte for byte.  Non-zero pages start
 * with a header naming seed/round/index, so a misplaced page is diagnosable.
 * The mix of page kinds is meant to compress like real guest memory (lz4
 * ratio ~2-3): zero pages, text, small-integer/pointer arrays, repeated
 * motifs and incompressible random data.
 *
 * Modes (all print machine-parseable lines, exit 1 on any mismatch):
 *   vzram-pressure [--rounds R] [--seed S] MIB [ROUNDS]
 *       anonymous memory: fill, then R-1 times verify+rewrite, then verify.
 *       -> "PRESSURE rounds=R pages=N mismatches=M secs=T"
 *   vzram-pressure --dev PATH --write MIB [--seed S] [--offset MIB] [--round N]
 *   vzram-pressure --dev PATH --verify MIB [--seed S] [--offset MIB] [--round N]
 *       O_DIRECT pattern on a block device (reconnect tests).
 *       -> "RAW written pages=N" / "RAW verify ok mismatches=0 pages=N"
 *   vzram-pressure --gen MIB [--seed S] [--round N]
 *       write the pattern to stdout (file content for the fs tests).
 *   vzram-pressure --stats MIB [--seed S]
 *       print the page-kind mix (for tuning the compressibility).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096u
#define MAGIC 0x47505a56u /* "VZPG" little endian */
#define MAX_REPORT 10

enum kind { K_ZERO, K_TEXT, K_INTS, K_MOTIF, K_RANDOM, K_COUNT };
static const char *kind_name[K_COUNT] = {"zero", "text", "ints", "motif", "random"};

struct hdr {
    uint32_t magic;
    uint32_t kind;
    uint64_t index;
    uint32_t round;
    uint32_t seed;
    uint64_t check; /* mixes the fields above; catches torn headers */
};

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t page_state(uint32_t seed, uint32_t round, uint64_t idx)
{
    uint64_t s = ((uint64_t)seed << 32 | round) ^ (idx * 0xd1342543de82ef95ull);
    splitmix(&s);
    return s;
}

static enum kind page_kind(uint64_t st)
{
    uint64_t s = st;
    unsigned r = (unsigned)(splitmix(&s) % 100);
    if (r < 30) return K_ZERO;
    if (r < 65) return K_TEXT;
    if (r < 80) return K_INTS;
    if (r < 90) return K_MOTIF;
    return K_RANDOM;
}

static const char *words[64] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with",
    "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which",
    "int", "return", "struct", "static", "const", "void", "if", "else", "for", "while",
    "unsigned", "long", "char", "NULL", "size_t", "err", "goto", "out", "buf", "len",
    "memory", "page", "swap", "block", "device", "queue", "request", "virtio", "vhost",
    "zram", "guest", "host", "kernel", "data", "write", "read", "flush", "discard",
    "=", "{",
};

static void gen_page(uint8_t *p, uint32_t seed, uint32_t round, uint64_t idx)
{
    uint64_t st = page_state(seed, round, idx);
    enum kind k = page_kind(st);
    if (k == K_ZERO) {
        memset(p, 0, PAGE);
        return;
    }
    struct hdr h = {MAGIC, (uint32_t)k, idx, round, seed, 0};
    h.check = page_state(seed ^ 0x5a5a5a5au, round ^ (uint32_t)k, idx);
    memcpy(p, &h, sizeof h);
    uint8_t *b = p + sizeof h, *end = p + PAGE;
    uint64_t s = st ^ 0xa5a5a5a5a5a5a5a5ull;
    switch (k) {
    case K_TEXT: {
        unsigned col = 0;
        while (b < end) {
            uint64_t r = splitmix(&s);
            for (int i = 0; i < 10 && b < end; i++, r >>= 6) {
                const char *w = words[r & 63];
                size_t n = strlen(w);
                if ((size_t)(end - b) < n + 1) n = (size_t)(end - b) - 1;
                memcpy(b, w, n);
                b += n;
                col += (unsigned)n + 1;
                if (b < end) *b++ = col > 72 ? '\n' : ' ';
                if (col > 72) col = 0;
            }
        }
        break;
    }
    case K_INTS:
        /* Looks like kernel/heap structs: small counters, flags, pointers. */
        while (b + 8 <= end) {
            uint64_t r = splitmix(&s), v;
            switch (r & 3) {
            case 0: v = 0; break;
            case 1: v = (r >> 8) & 0xff; break;
            case 2: v = 0xffff888000000000ull | ((r >> 16) & 0xfffff8ull); break;
            default: v = (r >> 20) & 0xffffff; break;
            }
            memcpy(b, &v, 8);
            b += 8;
        }
        break;
    case K_MOTIF: {
        uint8_t motif[64];
        unsigned len = 8 + (unsigned)(splitmix(&s) % 57);
        for (unsigned i = 0; i < len; i += 8) {
            uint64_t r = splitmix(&s);
            memcpy(motif + i, &r, 8);
        }
        for (unsigned i = 0; b < end; i = (i + 1) % len) *b++ = motif[i];
        break;
    }
    default: /* K_RANDOM */
        while (b + 8 <= end) {
            uint64_t r = splitmix(&s);
            memcpy(b, &r, 8);
            b += 8;
        }
        break;
    }
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t reported;

/* Returns 1 on mismatch and prints a diagnosis for the first few. */
static int check_page(const char *tag, const uint8_t *got, uint8_t *want, uint32_t seed,
                      uint32_t round, uint64_t idx)
{
    gen_page(want, seed, round, idx);
    if (memcmp(got, want, PAGE) == 0) return 0;
    if (reported++ < MAX_REPORT) {
        unsigned off = 0;
        while (off < PAGE && got[off] == want[off]) off++;
        struct hdr h;
        memcpy(&h, got, sizeof h);
        printf("%s-MISMATCH page=%" PRIu64 " round=%u seed=%u first_bad_off=%u "
               "want_kind=%s got_magic=%s got_index=%" PRIu64 " got_round=%u got_seed=%u\n",
               tag, idx, round, seed, off, kind_name[page_kind(page_state(seed, round, idx))],
               h.magic == MAGIC ? "yes" : "no", h.index, h.round, h.seed);
        fflush(stdout);
    }
    return 1;
}

static int mode_pressure(uint64_t mib, unsigned rounds, uint32_t seed)
{
    uint64_t pages = mib * (1024 * 1024 / PAGE), bad = 0;
    uint8_t *want = aligned_alloc(PAGE, PAGE);
    uint8_t *mem = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED || !want) {
        printf("PRESSURE error=mmap mib=%" PRIu64 " errno=%d\n", mib, errno);
        return 2;
    }
    double t0 = now();
    /* Round r writes content "r"; every later pass first verifies what the
     * previous round wrote, so each page's content is checked exactly once
     * after it has (very likely) been swapped out and back in. */
    for (unsigned r = 0; r <= rounds; r++) {
        double tr = now();
        uint64_t rbad = 0;
        for (uint64_t i = 0; i < pages; i++) {
            uint8_t *p = mem + i * PAGE;
            if (r > 0) rbad += check_page("PRESSURE", p, want, seed, r - 1, i);
            if (r < rounds) gen_page(p, seed, r, i);
        }
        bad += rbad;
        printf("PRESSURE-ROUND pass=%u %s pages=%" PRIu64 " mismatches=%" PRIu64 " secs=%.1f\n",
               r, r == 0 ? "fill" : r < rounds ? "verify+rewrite" : "verify", pages, rbad,
               now() - tr);
        fflush(stdout);
    }
    printf("PRESSURE rounds=%u pages=%" PRIu64 " mib=%" PRIu64 " mismatches=%" PRIu64
           " secs=%.1f\n",
           rounds, pages, mib, bad, now() - t0);
    fflush(stdout);
    munmap(mem, pages * PAGE);
    return bad ? 1 : 0;
}

#define CHUNK_PAGES 256u /* 1 MiB per O_DIRECT request */

static int mode_raw(const char *dev, int write_mode, uint64_t mib, uint64_t off_mib,
                    uint32_t seed, uint32_t round)
{
    uint64_t pages = mib * 256, first = off_mib * 256, bad = 0;
    uint8_t *buf = aligned_alloc(PAGE, CHUNK_PAGES * PAGE), *want = aligned_alloc(PAGE, PAGE);
    /* O_DIRECT so the verify really reads the backend, not the guest page cache. */
    int fd = open(dev, (write_mode ? O_WRONLY : O_RDONLY) | O_DIRECT);
    if (fd < 0 || !buf || !want) {
        printf("RAW error=open dev=%s errno=%d\n", dev, errno);
        return 2;
    }
    double t0 = now();
    for (uint64_t i = 0; i < pages; i += CHUNK_PAGES) {
        uint64_t n = pages - i < CHUNK_PAGES ? pages - i : CHUNK_PAGES;
        off_t pos = (off_t)((first + i) * PAGE);
        if (write_mode) {
            for (uint64_t j = 0; j < n; j++) gen_page(buf + j * PAGE, seed, round, first + i + j);
            if (pwrite(fd, buf, n * PAGE, pos) != (ssize_t)(n * PAGE)) {
                printf("RAW error=write off=%lld errno=%d\n", (long long)pos, errno);
                return 2;
            }
        } else {
            if (pread(fd, buf, n * PAGE, pos) != (ssize_t)(n * PAGE)) {
                printf("RAW error=read off=%lld errno=%d\n", (long long)pos, errno);
                return 2;
            }
            for (uint64_t j = 0; j < n; j++)
                bad += check_page("RAW", buf + j * PAGE, want, seed, round, first + i + j);
        }
    }
    if (write_mode && fsync(fd) != 0) {
        printf("RAW error=fsync errno=%d\n", errno);
        return 2;
    }
    close(fd);
    if (write_mode)
        printf("RAW written pages=%" PRIu64 " seed=%u secs=%.1f\n", pages, seed, now() - t0);
    else
        printf("RAW verify %s mismatches=%" PRIu64 " pages=%" PRIu64 " seed=%u secs=%.1f\n",
               bad ? "FAIL" : "ok", bad, pages, seed, now() - t0);
    fflush(stdout);
    return bad ? 1 : 0;
}

static int mode_gen(uint64_t mib, uint32_t seed, uint32_t round)
{
    static uint8_t buf[CHUNK_PAGES * PAGE];
    uint64_t pages = mib * 256;
    for (uint64_t i = 0; i < pages; i += CHUNK_PAGES) {
        uint64_t n = pages - i < CHUNK_PAGES ? pages - i : CHUNK_PAGES;
        for (uint64_t j = 0; j < n; j++) gen_page(buf + j * PAGE, seed, round, i + j);
        if (fwrite(buf, PAGE, n, stdout) != n) return 2;
    }
    return fflush(stdout) ? 2 : 0;
}

static int mode_stats(uint64_t mib, uint32_t seed)
{
    uint64_t n[K_COUNT] = {0}, pages = mib * 256;
    for (uint64_t i = 0; i < pages; i++) n[page_kind(page_state(seed, 0, i))]++;
    for (int k = 0; k < K_COUNT; k++)
        printf("KIND %s=%" PRIu64 " (%.1f%%)\n", kind_name[k], n[k], 100.0 * n[k] / pages);
    return 0;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: vzram-pressure [--rounds R] [--seed S] MIB [ROUNDS]\n"
            "       vzram-pressure --dev PATH (--write|--verify) MIB [--offset MIB] [--seed S] "
            "[--round N]\n"
            "       vzram-pressure --gen MIB [--seed S] [--round N]\n"
            "       vzram-pressure --stats MIB [--seed S]\n");
    exit(2);
}

static uint64_t num(const char *s)
{
    char *e;
    errno = 0;
    unsigned long long v = strtoull(s, &e, 0);
    if (errno || *e || e == s) usage();
    return v;
}

int main(int argc, char **argv)
{
    const char *dev = NULL;
    int mode = 'p'; /* p=pressure w=write v=verify g=gen s=stats */
    uint64_t mib = 0, off = 0, rounds = 2, seed = 1, round = 0;
    int have_mib = 0, npos = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
#define NEXT() (i + 1 < argc ? argv[++i] : (usage(), ""))
        if (!strcmp(a, "--dev")) dev = NEXT();
        else if (!strcmp(a, "--write")) mode = 'w', mib = num(NEXT()), have_mib = 1;
        else if (!strcmp(a, "--verify")) mode = 'v', mib = num(NEXT()), have_mib = 1;
        else if (!strcmp(a, "--gen")) mode = 'g', mib = num(NEXT()), have_mib = 1;
        else if (!strcmp(a, "--stats")) mode = 's', mib = num(NEXT()), have_mib = 1;
        else if (!strcmp(a, "--offset")) off = num(NEXT());
        else if (!strcmp(a, "--seed")) seed = num(NEXT());
        else if (!strcmp(a, "--round")) round = num(NEXT());
        else if (!strcmp(a, "--rounds")) rounds = num(NEXT());
        else if (a[0] == '-') usage();
        else if (npos == 0) mib = num(a), have_mib = 1, npos++;
        else if (npos == 1) rounds = num(a), npos++;
        else usage();
    }
    if (!have_mib || mib == 0) usage();
    switch (mode) {
    case 'w':
    case 'v':
        if (!dev) usage();
        return mode_raw(dev, mode == 'w', mib, off, (uint32_t)seed, (uint32_t)round);
    case 'g': return mode_gen(mib, (uint32_t)seed, (uint32_t)round);
    case 's': return mode_stats(mib, (uint32_t)seed);
    default:
        if (rounds < 1) usage();
        return mode_pressure(mib, (unsigned)rounds, (uint32_t)seed);
    }
}
