/* Sharing a loop of chunks among the threads of a parallel region: each thread
   starts on its own contiguous share, as a static schedule would (it streams its own
   part of the weights), and a thread done with its share takes the chunks left in
   the others'. A server shares these cores with its event loop and its clients: a
   thread the OS preempts then delays a few chunks rather than half of every layer. */

#ifndef CARPOOL_WORK_SHARE_H
#define CARPOOL_WORK_SHARE_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t next, end;
    char pad[48]; /* one cache line each: the owners claim without false sharing */
} Share;

/* count contiguous shares of chunks [0, chunks); NULL when out of memory */
static Share *new_shares(int64_t chunks, int count) {
    Share *shares = malloc(sizeof(Share) * (size_t)count);
    if (shares == NULL) return NULL;
    for (int t = 0; t < count; t++) {
        shares[t].next = chunks * t / count;
        shares[t].end = chunks * (t + 1) / count;
    }
    return shares;
}

/* The next chunk for thread self (start *victim at 0), or -1 when none is left. */
static inline int64_t next_chunk(Share *shares, int count, int self, int *victim) {
    for (; *victim < count; (*victim)++) {
        Share *share = shares + (self + *victim) % count;
        const int64_t chunk = __atomic_fetch_add(&share->next, 1, __ATOMIC_RELAXED);
        if (chunk < share->end) return chunk;
    }
    return -1;
}

#endif
