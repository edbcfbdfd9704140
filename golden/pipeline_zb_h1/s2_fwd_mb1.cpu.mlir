module @jit_s2_fwd_mb1 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x4x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<16x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg4: tensor<16x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg5: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<4x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16x4xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %0 = stablehlo.slice %arg0 [1:2, 0:4, 0:4] : (tensor<4x4x4xf32>) -> tensor<1x4x4xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.dot_general %arg1, %arg2, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<16x4xf32>) -> tensor<4x4xf32>
    %3 = stablehlo.broadcast_in_dim %arg3, dims = [1] : (tensor<4xf32>) -> tensor<1x4xf32>
    %4 = stablehlo.broadcast_in_dim %3, dims = [0, 1] : (tensor<1x4xf32>) -> tensor<4x4xf32>
    %5 = stablehlo.add %2, %4 : tensor<4x4xf32>
    %6 = stablehlo.tanh %5 : tensor<4x4xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %8 = stablehlo.subtract %7, %6 : tensor<4x4xf32>
    %9 = stablehlo.subtract %6, %1 : tensor<4x4xf32>
    %cst_0 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %10 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %11 = stablehlo.multiply %10, %9 : tensor<4x4xf32>
    %cst_1 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_2 = stablehlo.constant dense<1.600000e+01> : tensor<f32>
    %12 = stablehlo.divide %cst_1, %cst_2 : tensor<f32>
    %13 = stablehlo.broadcast_in_dim %12, dims = [] : (tensor<f32>) -> tensor<4x4xf32>
    %14 = stablehlo.multiply %13, %11 : tensor<4x4xf32>
    %15 = stablehlo.multiply %14, %8 : tensor<4x4xf32>
    %16 = stablehlo.multiply %15, %6 : tensor<4x4xf32>
    %17 = stablehlo.add %15, %16 : tensor<4x4xf32>
    %cst_3 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %18 = stablehlo.reduce(%17 init: %cst_3) applies stablehlo.add across dimensions = [0] : (tensor<4x4xf32>, tensor<f32>) -> tensor<4xf32>
    %19 = stablehlo.reshape %18 : (tensor<4xf32>) -> tensor<1x4xf32>
    %cst_4 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %20 = stablehlo.reduce(%19 init: %cst_4) applies stablehlo.add across dimensions = [0] : (tensor<1x4xf32>, tensor<f32>) -> tensor<4xf32>
    %21 = stablehlo.dot_general %17, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
    %22 = stablehlo.transpose %21, dims = [1, 0] : (tensor<4x16xf32>) -> tensor<16x4xf32>
    %23 = stablehlo.dot_general %17, %arg2, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<4x4xf32>, tensor<16x4xf32>) -> tensor<4x16xf32>
    %24 = stablehlo.add %arg4, %22 : tensor<16x4xf32>
    %25 = stablehlo.add %arg5, %20 : tensor<4xf32>
    return %23, %24, %25 : tensor<4x16xf32>, tensor<16x4xf32>, tensor<4xf32>
  }
}
