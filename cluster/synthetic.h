// cluster/synthetic.h — deterministic synthetic BatchNorm data, and a reference reduction.
//
// Any process can regenerate any rank's data for any round from (seed, rank, round), so a
// worker can check its own results and a test can recompute what every worker contributed.
// Each worker's data has its own per-channel mean and spread (the distribution differs per
// worker, as it does when data is not shuffled uniformly), which makes node and global scope
// give visibly different statistics.
//
// The reference reduction uses a two-pass algorithm in long double over the concatenated data:
// independent of the Welford/Chan code it checks.
#ifndef HSBN_CLUSTER_SYNTHETIC_H_
#define HSBN_CLUSTER_SYNTHETIC_H_

#include <cstdint>
#include <vector>

namespace hsbn::synthetic {

// Values of one rank in one round: count x channels, row-major ([i * channels + c]).
std::vector<double> Input(uint64_t seed, int rank, uint64_t round, int64_t count,
                          int64_t channels);
// The upstream gradient dy for the same rank and round, same layout.
std::vector<double> Grad(uint64_t seed, int rank, uint64_t round, int64_t count,
                         int64_t channels);

struct Stats {
  int64_t count = 0;
  std::vector<double> a, b;  // forward: mean, m2; backward: sum_dy, sum_dy_xmu
};

// Local moments the way a worker computes them (Welford per channel, hsbn/moments.h).
Stats LocalMoments(const std::vector<double>& x, int64_t count, int64_t channels);
// Local backward sums given the reduced mean.
Stats LocalBackward(const std::vector<double>& x, const std::vector<double>& dy, int64_t count,
                    int64_t channels, const std::vector<double>& mean);

// Reference: moments of the concatenation of `parts` (each count_i x channels), two-pass in
// long double.
Stats ReferenceMoments(const std::vector<std::vector<double>>& parts,
                       const std::vector<int64_t>& counts, int64_t channels);
// Reference backward sums over the concatenation, in long double.
Stats ReferenceBackward(const std::vector<std::vector<double>>& xs,
                        const std::vector<std::vector<double>>& dys,
                        const std::vector<int64_t>& counts, int64_t channels,
                        const std::vector<double>& mean);

// Largest relative difference |got - want| / max(|want|, floor) over the arrays.
double MaxRelativeError(const std::vector<double>& got, const std::vector<double>& want,
                        double floor = 1e-12);

}  // namespace hsbn::synthetic

#endif  // HSBN_CLUSTER_SYNTHETIC_H_
