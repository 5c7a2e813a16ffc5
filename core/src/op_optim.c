/*
 * op_optim.c -- the public fused optimiser updates (gdp.h, "optimisers"): argument
 * checks with messages, the hyperparameters folded into the update's scalars in double
 * (kernels/optim_problem.h), then one call of the backend's optim_update.
 *
 * Every buffer is used in place: the updates allocate nothing, so a training step's
 * optimiser pass is one kernel per parameter and no copies.
 */
#include <math.h>
#include <stdio.h>

#include "backend_impl.h"

static const char *shape_of(char *buf, size_t len, const gdp_tensor *t) {
  return gdp_shape_str(buf, len, t->ndim, t->shape);
}

/* The dtype of the masters and moments for a parameter of dtype `param`. */
static gdp_dtype state_dtype_for(gdp_dtype param) {
  return param == GDP_DTYPE_F64 ? GDP_DTYPE_F64 : GDP_DTYPE_F32;
}

/* t (may be NULL when optional) is a contiguous tensor shaped and placed like param,
 * of dtype `want` (-1: any float dtype), sharing no memory with param. */
static gdp_status check_buffer(const char *func, const char *name, const gdp_tensor *t,
                               const gdp_tensor *param, int want) {
  if (!t) return GDP_OK;
  const gdp_ctx *pc = param->storage->ctx, *tc = t->storage->ctx;
  if (tc->type != pc->type || tc->index != pc->index)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected a tensor on %s:%d (param's device), got %s:%d", name,
                        gdp_device_type_name(pc->type), pc->index,
                        gdp_device_type_name(tc->type), tc->index);
  int same = t->ndim == param->ndim;
  for (int i = 0; same && i < t->ndim; i++) same = t->shape[i] == param->shape[i];
  if (!same) {
    char a[160], b[160];
    return GDP_ERROR_IN(func, GDP_ERR_SHAPE, "%s: expected param's shape %s, got %s", name,
                        shape_of(b, sizeof b, param), shape_of(a, sizeof a, t));
  }
  if (want >= 0 && (int)t->dtype != want)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "%s: expected dtype %s for a %s param, got %s",
                        name, gdp_dtype_name((gdp_dtype)want), gdp_dtype_name(param->dtype),
                        gdp_dtype_name(t->dtype));
  if (!gdp_tensor_is_contiguous(t))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: expected a contiguous tensor (the update runs over flat buffers), "
                        "got strides that are not (use :contiguous())",
                        name);
  if (t->storage == param->storage)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "%s: shares memory with param (each buffer of an update must be its own)",
                        name);
  return GDP_OK;
}

/* Checks param and grad, the state tensors (NULL where absent) and master (required
 * exactly for bf16 params), and fills the update's buffers and dtypes. */
static gdp_status check_tensors(const char *func, gdp_tensor *param, const gdp_tensor *grad,
                                gdp_tensor *master, const char *s0_name, gdp_tensor *s0,
                                const char *s1_name, gdp_tensor *s1, gdp_optim_update *u) {
  if (!param) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "param: expected a tensor, got NULL");
  if (!grad) return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "grad: expected a tensor, got NULL");
  const gdp_dtype pd = param->dtype;
  if (pd != GDP_DTYPE_F64 && pd != GDP_DTYPE_F32 && pd != GDP_DTYPE_BF16)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "param: expected dtype f64, f32 or bf16, got %s",
                        gdp_dtype_name(pd));
  if (!gdp_tensor_is_contiguous(param))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "param: expected a contiguous tensor (the update runs over flat buffers)");
  const gdp_dtype sd = state_dtype_for(pd);
  GDP_TRY(check_buffer(func, "grad", grad, param, -1));
  const int grad_ok = grad->dtype == pd || (pd == GDP_DTYPE_BF16 && grad->dtype == GDP_DTYPE_F32);
  if (!grad_ok)
    return GDP_ERROR_IN(func, GDP_ERR_DTYPE, "grad: expected dtype %s%s for a %s param, got %s",
                        gdp_dtype_name(pd), pd == GDP_DTYPE_BF16 ? " or f32" : "",
                        gdp_dtype_name(pd), gdp_dtype_name(grad->dtype));
  if (pd == GDP_DTYPE_BF16 && !master)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "master: a bf16 param needs its float32 master weights, got NULL");
  if (pd != GDP_DTYPE_BF16 && master)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "master: expected NULL for a %s param (it is its own master), got a tensor",
                        gdp_dtype_name(pd));
  GDP_TRY(check_buffer(func, "master", master, param, sd));
  GDP_TRY(check_buffer(func, s0_name, s0, param, sd));
  GDP_TRY(check_buffer(func, s1_name, s1, param, sd));
  const struct {
    const char *name;
    const gdp_tensor *t;
  } bufs[4] = {{"grad", grad}, {"master", master}, {s0_name, s0}, {s1_name, s1}};
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++)
      if (bufs[i].t && bufs[j].t && bufs[i].t->storage == bufs[j].t->storage)
        return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s and %s share memory (each buffer of "
                            "an update must be its own)", bufs[i].name, bufs[j].name);
  u->n = gdp_tensor_numel(param);
  u->param_dtype = pd;
  u->grad_dtype = grad->dtype;
  u->state_dtype = sd;
  u->param = gdp_tensor_data(param);
  u->grad = gdp_tensor_data(grad);
  u->master = master ? gdp_tensor_data(master) : NULL;
  u->state0 = s0 ? gdp_tensor_data(s0) : NULL;
  u->state1 = s1 ? gdp_tensor_data(s1) : NULL;
  u->num_threads = param->storage->ctx->num_threads;
  return GDP_OK;
}

static gdp_status check_range(const char *func, const char *name, double x, double lo,
                              double hi, int hi_open) {
  if (isfinite(x) && x >= lo && (hi_open ? x < hi : x <= hi)) return GDP_OK;
  return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a number in [%g, %g%s, got %g",
                      name, lo, hi, hi_open ? ")" : "]", x);
}

static gdp_status run_update(const char *func, gdp_tensor *param, const gdp_optim_update *u,
                             gdp_tensor *const *written, int nwritten) {
  gdp_ctx *ctx = param->storage->ctx;
  if (!ctx->backend->optim_update) return GDP_NOT_IMPLEMENTED(func, ctx);
  if (u->n == 0) return GDP_OK;
  for (int i = 0; i < nwritten; i++)
    if (written[i]) gdp_tensor_mark_written(written[i]);
  return ctx->backend->optim_update(ctx, u);
}

gdp_status gdp_optim_adamw_step(gdp_tensor *param, const gdp_tensor *grad, gdp_tensor *exp_avg,
                                gdp_tensor *exp_avg_sq, gdp_tensor *master, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                int64_t step) {
  const char *func = __func__;
  gdp_optim_update u = {0};
  u.kind = GDP_OPTIM_ADAMW;
  GDP_TRY(check_tensors(func, param, grad, master, "exp_avg", exp_avg, "exp_avg_sq", exp_avg_sq,
                        &u));
  if (!exp_avg || !exp_avg_sq)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "%s: expected a tensor, got NULL",
                        exp_avg ? "exp_avg_sq" : "exp_avg");
  GDP_TRY(check_range(func, "lr", lr, 0, INFINITY, 1));
  GDP_TRY(check_range(func, "beta1", beta1, 0, 1, 1));
  GDP_TRY(check_range(func, "beta2", beta2, 0, 1, 1));
  GDP_TRY(check_range(func, "weight_decay", weight_decay, 0, INFINITY, 1));
  if (!(isfinite(eps) && eps > 0))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG, "eps: expected a finite number > 0, got %g", eps);
  if (step < 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "step: expected the 1-based number of this update, >= 1, got %lld",
                        (long long)step);
  u.lr = lr;
  u.weight_decay = weight_decay;
  u.beta1 = beta1;
  u.beta2 = beta2;
  u.eps = eps;
  u.decay = 1.0 - lr * weight_decay;
  u.step_size = lr / (1.0 - pow(beta1, (double)step));
  u.bc2_sqrt = sqrt(1.0 - pow(beta2, (double)step));
  gdp_tensor *written[4] = {param, master, exp_avg, exp_avg_sq};
  return run_update(func, param, &u, written, 4);
}

gdp_status gdp_optim_sgd_step(gdp_tensor *param, const gdp_tensor *grad,
                              gdp_tensor *momentum_buffer, gdp_tensor *master, double lr,
                              double momentum, double dampening, double weight_decay,
                              int nesterov, int64_t step) {
  const char *func = __func__;
  gdp_optim_update u = {0};
  u.kind = GDP_OPTIM_SGD;
  GDP_TRY(check_tensors(func, param, grad, master, "momentum_buffer", momentum_buffer, "unused",
                        NULL, &u));
  GDP_TRY(check_range(func, "lr", lr, 0, INFINITY, 1));
  GDP_TRY(check_range(func, "momentum", momentum, 0, INFINITY, 1));
  GDP_TRY(check_range(func, "dampening", dampening, 0, 1, 0));
  GDP_TRY(check_range(func, "weight_decay", weight_decay, 0, INFINITY, 1));
  if (step < 1)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "step: expected the 1-based number of this update, >= 1, got %lld",
                        (long long)step);
  if (nesterov && (momentum <= 0 || dampening != 0))
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "nesterov: needs momentum > 0 and dampening 0, got momentum %g, "
                        "dampening %g",
                        momentum, dampening);
  if (momentum > 0 && !momentum_buffer)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "momentum_buffer: expected a tensor when momentum > 0 (%g), got NULL",
                        momentum);
  if (momentum == 0 && momentum_buffer)
    return GDP_ERROR_IN(func, GDP_ERR_INVALID_ARG,
                        "momentum_buffer: expected NULL when momentum is 0, got a tensor");
  u.lr = lr;
  u.weight_decay = weight_decay;
  u.momentum = momentum;
  u.dampening = dampening;
  u.nesterov = nesterov != 0;
  u.first = step == 1;
  gdp_tensor *written[3] = {param, master, momentum_buffer};
  return run_update(func, param, &u, written, 3);
}
