module @jit_s0_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.tanh %0 : tensor<4x8xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %3 = stablehlo.subtract %2, %1 : tensor<4x8xf32>
    %4 = stablehlo.multiply %1, %1 : tensor<4x8xf32>
    %cst_0 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %6 = stablehlo.multiply %5, %1 : tensor<4x8xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %7 = stablehlo.reduce(%4 init: %cst_1) applies stablehlo.add across dimensions = [0, 1] : (tensor<4x8xf32>, tensor<f32>) -> tensor<f32>
    %cst_2 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %8 = stablehlo.divide %7, %cst_2 : tensor<f32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_4 = stablehlo.constant dense<3.200000e+01> : tensor<f32>
    %9 = stablehlo.divide %cst_3, %cst_4 : tensor<f32>
    %10 = stablehlo.broadcast_in_dim %9, dims = [] : (tensor<f32>) -> tensor<4x8xf32>
    %11 = stablehlo.multiply %10, %6 : tensor<4x8xf32>
    %12 = stablehlo.multiply %11, %3 : tensor<4x8xf32>
    %13 = stablehlo.multiply %12, %1 : tensor<4x8xf32>
    %14 = stablehlo.add %12, %13 : tensor<4x8xf32>
    %15 = stablehlo.dot_general %14, %arg0, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<8x8xf32>
    %16 = stablehlo.transpose %15, dims = [1, 0] : (tensor<8x8xf32>) -> tensor<8x8xf32>
    return %8, %16 : tensor<f32>, tensor<8x8xf32>
  }
}
