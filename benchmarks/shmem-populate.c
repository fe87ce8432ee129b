/* What a new span's pages cost: anonymous memory against a MAP_SHARED
 * tmpfs file (a device's state), and the ways of backing them we tried.
 * Spans as the arena lays them out: the first PAGES pages of each 32 KiB
 * block, then filled (memset) as objects would fill them; then given back
 * as an emptied span is. Thread CPU time, so a busy neighbour matters less.
 * See BENCHMARKS.md section 5.
 *
 *   cc -O2 -o /tmp/shmem-populate benchmarks/shmem-populate.c
 *   /tmp/shmem-populate MODE PAGES BLOCKS    (file in /dev/shm)
 *
 * MODE 0 anonymous, MADV_POPULATE_WRITE per span (what anonymous devices do)
 *      1 tmpfs file, MADV_POPULATE_WRITE per span (what state files do)
 *      2 tmpfs file, fallocate the span, then MADV_POPULATE_WRITE
 *      3 tmpfs file, no populate: the writes fault page by page
 *      4 tmpfs file, fallocate 64 blocks at a time ahead of need, then
 *        MADV_POPULATE_WRITE per span
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define BLOCK (32 * 1024)
#define PAGE 4096

static double cpu_now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: %s MODE PAGES BLOCKS\n", argv[0]);
		return 2;
	}
	int mode = atoi(argv[1]), pages = atoi(argv[2]);
	long blocks = atol(argv[3]);
	size_t len = (size_t)blocks * BLOCK;
	const char *path = "/dev/shm/vzram-shmem-populate";
	int fd = -1;
	char *p;
	if (mode == 0) {
		p = mmap(0, len, PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	} else {
		fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
		if (fd < 0 || ftruncate(fd, len) != 0) {
			perror(path);
			return 1;
		}
		p = mmap(0, len, PROT_READ | PROT_WRITE,
			 MAP_SHARED | MAP_NORESERVE, fd, 0);
	}
	if (p == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	madvise(p, len, MADV_NOHUGEPAGE);

	double t = cpu_now();
	for (long b = 0; b < blocks; b++) {
		char *s = p + b * BLOCK;
		size_t n = (size_t)pages * PAGE;
		switch (mode) {
		case 0:
		case 1:
			madvise(s, n, MADV_POPULATE_WRITE);
			break;
		case 2:
			fallocate(fd, 0, b * BLOCK, n);
			madvise(s, n, MADV_POPULATE_WRITE);
			break;
		case 3:
			break;
		case 4:
			if (b % 64 == 0)
				fallocate(fd, FALLOC_FL_KEEP_SIZE, b * BLOCK,
					  64L * BLOCK);
			madvise(s, n, MADV_POPULATE_WRITE);
			break;
		}
		memset(s, 1, n);
	}
	double fill = cpu_now() - t;

	t = cpu_now();
	for (long b = 0; b < blocks; b++)
		madvise(p + b * BLOCK, (size_t)pages * PAGE,
			mode == 0 ? MADV_DONTNEED : MADV_REMOVE);
	double release = cpu_now() - t;

	printf("mode %d, %d pages a span: back and fill %.0f ns/page, give back %.0f ns/page\n",
	       mode, pages, fill * 1e9 / (blocks * pages),
	       release * 1e9 / (blocks * pages));
	if (fd >= 0)
		unlink(path);
	return 0;
}
