/* gdp_bwd_v3.cu's kernels for K = 64, V = 128 (gdp_v3_split.h). */
#define GDP_V3_SPLIT
#define GDP_V3_PART_K 64
#define GDP_V3_PART_V 128
#include "../gdp_bwd_v3.cu"
