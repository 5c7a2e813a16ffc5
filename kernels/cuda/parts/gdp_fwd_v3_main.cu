/* gdp_fwd_v3.cu without its kernels: dispatchers and entry points (gdp_v3_split.h). */
#define GDP_V3_SPLIT
#include "../gdp_fwd_v3.cu"
