module @jit_s1_wgrad_mb3 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg4: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg5: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<16x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<4x16xf32>, tensor<f32>) -> tensor<16xf32>
    %1 = stablehlo.reshape %0 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %2 = stablehlo.reduce(%1 init: %cst_0) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %3 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<16x16xf32>
    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.add %arg2, %4 : tensor<16x16xf32>
    %cst_1 = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %6 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %7 = stablehlo.divide %5, %6 : tensor<16x16xf32>
    %8 = stablehlo.add %arg3, %2 : tensor<16xf32>
    %cst_2 = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %9 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %10 = stablehlo.divide %8, %9 : tensor<16xf32>
    %cst_3 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %11 = stablehlo.broadcast_in_dim %cst_3, dims = [] : (tensor<f32>) -> tensor<16x16xf32>
    %12 = stablehlo.multiply %11, %7 : tensor<16x16xf32>
    %13 = stablehlo.subtract %arg4, %12 : tensor<16x16xf32>
    %cst_4 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %14 = stablehlo.broadcast_in_dim %cst_4, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %15 = stablehlo.multiply %14, %10 : tensor<16xf32>
    %16 = stablehlo.subtract %arg5, %15 : tensor<16xf32>
    return %13, %16 : tensor<16x16xf32>, tensor<16xf32>
  }
}
