// Launch heuristics of the decode op, as pure functions of the call's shape and the device: how many
// splits of the keys a launch takes. (Which kernel runs is decided in Python, flash_attn_tq/dispatch.py;
// the measurements behind these rules are in docs/decisions.md.)
#pragma once

#include <algorithm>
#include <cstdint>

namespace flash_tq {

// A prefill CTA's query rows (8 warps over tiles expanded once into shared memory).
constexpr int kPrefillRowsPerCta = 256;
// A launch with a 16-bit side: one row tile fits <= 168 registers, so three CTAs an SM.
constexpr int kSideSlotsPerSm = 3;

// The number of splits of the keys. The busiest SM holds ceil(ctas * s / num_sms) CTAs of 1/s of a
// sequence each, so time goes as load(s) = ceil(ctas * s / num_sms) / s. Among the split counts within
// 5% of the best load, take the first that puts about per_sm_x20 / 20 CTAs on every SM (default 1.9:
// two 4-warp CTAs), else the fewest (each split adds a prologue, a merge and combine work); at least
// 128 keys a split. side_ctas: the CTAs of a 16-bit side in the same launch, which start after the
// codes' and take SM slots: a count whose code CTAs are short (< 512 keys) must leave them a slot
// (kSideSlotsPerSm), or they run as a second wave as long as the first.
inline int choose_num_splits(int ctas, int max_seqlen_k, int num_sms, int per_sm_x20 = 38, int side_ctas = 0) {
    int max_splits = std::max(1, std::min(128, max_seqlen_k / 128));
    while (side_ctas > 0 && max_splits > 1 && max_seqlen_k / max_splits < 512 &&
           static_cast<int64_t>(ctas) * max_splits + side_ctas > static_cast<int64_t>(kSideSlotsPerSm) * num_sms) {
        --max_splits;
    }
    auto load = [&](int s) {
        return static_cast<double>((static_cast<int64_t>(ctas) * s + num_sms - 1) / num_sms) / s;
    };
    double best = load(1);
    for (int s = 2; s <= max_splits; ++s) { best = std::min(best, load(s)); }
    int fewest = 0;
    for (int s = 1; s <= max_splits; ++s) {
        if (load(s) > 1.05 * best) continue;
        if (fewest == 0) fewest = s;
        if (static_cast<int64_t>(ctas) * s * 20 >= static_cast<int64_t>(num_sms) * per_sm_x20) return s;
    }
    return fewest;
}

// A launch with a 16-bit side asks for more CTAs an SM (2.9): its short side CTAs take SM slots.
constexpr int kSidePerSmX20 = 58;

// A second head group of wider codes (the pair launch) splits its keys into as many more splits as its
// codes' bits over the first group's, so that the two groups' CTAs are of about one length.
inline int pair_num_splits(int num_splits, int span, int k_bits, int v_bits, int k_bits2, int v_bits2) {
    return std::min(std::max(1, std::min(128, span / 128)),
                    (num_splits * (k_bits2 + v_bits2) + k_bits + v_bits - 1) / (k_bits + v_bits));
}

}  // namespace flash_tq
