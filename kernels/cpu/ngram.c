/* Prompt lookup's match (llmd.daemon.engine.ngram_proposer.lookup): where the last token of a
 * sequence occurred before, agreeing with the tokens before it for longest.
 *
 * Why in C: the lookup runs for every drafting sequence before every step, right after a decode
 * step has streamed the weights through the caches; a dozen numpy calls then took ~150 us a sequence
 * (each call's code and data cold), this one call ~40 us, the same answer.
 */
#include <stdint.h>

/* tokens[0..n): the latest end e < n - 1 with tokens[e] == tokens[n - 1] whose agreement with the
 * context, followed back from there without a break, is longest, up to `context` tokens (the last
 * one included): *length gets it. Returns e, or -1 (length 0) when the last token does not recur.
 * Scanning from the end, a longer agreement replaces a shorter one, never an equal one: the latest
 * of the longest. */
int64_t llmd_ngram_match(const int64_t *tokens, int64_t n, int64_t context, int64_t *length) {
    *length = 0;
    if (n < 2 || context < 1) return -1;
    const int64_t last = tokens[n - 1];
    const int64_t depth = (context < n - 1 ? context : n - 1) - 1; /* tokens compared before the last */
    int64_t best = -1, best_end = -1;
    for (int64_t e = n - 2; e >= 0; e--) {
        if (tokens[e] != last) continue;
        int64_t a = 0;
        while (a < depth && a < e && tokens[e - 1 - a] == tokens[n - 2 - a]) a++;
        if (a > best) {
            best = a, best_end = e;
            if (best == depth) break; /* none earlier can agree longer, nor win a tie */
        }
    }
    if (best_end >= 0) *length = best + 1;
    return best_end;
}
