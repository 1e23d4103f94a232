// The pictures of `moe plot` in a build without cairo (`make PLOT=0`, or libcairo2-dev missing):
// the command says how to get them.
#include "figures.h"

int figures_write(const PlotRun *runs, size_t n, const FigureOptions *opt, FILE *out, MoeErr err) {
    return moe_err(err, "this moe was built without cairo, which draws the pictures: run scripts/setup.sh "
                   "(it installs libcairo2-dev), then make");
}
