/* placeholder: scalar until the avx2 kernels land */
#include "ina_kernels_ops.h"
const ina_kernel_ops ina_ops_avx2 = {
    "avx2", ina_scalar_nc_encode, ina_scalar_nc_decode, ina_scalar_fixed_nearest, ina_scalar_fixed_sr,
    ina_scalar_fixed_value, ina_scalar_dither_natural, ina_scalar_dither_standard,
};
