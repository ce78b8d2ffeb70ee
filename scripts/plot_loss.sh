#!/usr/bin/env bash
# Plot a gdncp train log (--log FILE.csv) as a PNG: training loss per step and validation loss.
# Usage: scripts/plot_loss.sh LOG.csv OUT.png [TITLE]
set -euo pipefail
csv=$1 png=$2 title=${3:-gdncp train}
[ -s "$csv" ] || { echo "plot_loss: $csv is missing or empty" >&2; exit 1; }
command -v gnuplot >/dev/null || { echo "plot_loss: gnuplot is not installed (scripts/deps.sh installs gnuplot-nox)" >&2; exit 1; }
gnuplot <<GP
set terminal pngcairo size 900,540 font ",11"
set output "$png"
set datafile separator ","
set datafile missing ""
set title "$title"
set xlabel "step"
set ylabel "loss (nats per byte)"
set grid
set key top right
plot "$csv" every ::1 using 1:2 with lines lw 1.5 lc rgb "#3070c0" title "training loss", \
     "$csv" every ::1 using 1:(\$3 == \$3 ? \$3 : NaN) with linespoints pt 7 ps 0.8 lw 2 lc rgb "#d04020" title "validation loss"
GP
echo "plot: $png"
