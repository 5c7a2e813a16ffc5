/* gdp_fwd_v3.cu's kernels for K = 128, n = 3 (gdp_v3_split.h). */
#define GDP_V3_SPLIT
#define GDP_V3_PART_K 128
#define GDP_V3_PART_N 3
#include "../gdp_fwd_v3.cu"
