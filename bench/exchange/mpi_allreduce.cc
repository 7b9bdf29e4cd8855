// mpi_allreduce — Open MPI's MPI_Allreduce(SUM) of the same 2*C + 1 doubles per round.
// Launched by mpirun; the driver picks the transport with --mca btl (vader = shared memory,
// tcp = loopback TCP). Each rank writes its samples to --out with "%r" replaced by its rank.
#include <mpi.h>

#include <string>
#include <vector>

#include "bench_common.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  hsbn_bench::Args args(argc, argv);
  hsbn_bench::Plan plan = hsbn_bench::Plan::FromArgs(args);
  auto pos = plan.out.find("%r");
  if (pos != std::string::npos) plan.out.replace(pos, 2, std::to_string(rank));
  hsbn_bench::RunPlan(plan, rank,
                      [&](int channels, hsbn_bench::Phase, hsbn_bench::Scope, const double* in,
                          double* out, uint32_t, uint64_t) {
                        MPI_Allreduce(in, out, 2 * channels + 1, MPI_DOUBLE, MPI_SUM,
                                      MPI_COMM_WORLD);
                      });
  MPI_Finalize();
  return 0;
}
