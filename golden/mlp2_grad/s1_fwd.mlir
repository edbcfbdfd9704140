module @jit_s1_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<32x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg3: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<32x8xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<8x32xf32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<32x8xf32>) -> tensor<8x8xf32>
    %1 = stablehlo.broadcast_in_dim %arg2, dims = [1] : (tensor<8xf32>) -> tensor<1x8xf32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [0, 1] : (tensor<1x8xf32>) -> tensor<8x8xf32>
    %3 = stablehlo.add %0, %2 : tensor<8x8xf32>
    %4 = stablehlo.tanh %3 : tensor<8x8xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
    %6 = stablehlo.subtract %5, %4 : tensor<8x8xf32>
    %7 = stablehlo.subtract %4, %arg3 : tensor<8x8xf32>
    %8 = stablehlo.multiply %7, %7 : tensor<8x8xf32>
    %cst_0 = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %9 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
    %10 = stablehlo.multiply %9, %7 : tensor<8x8xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %11 = stablehlo.reduce(%8 init: %cst_1) applies stablehlo.add across dimensions = [0, 1] : (tensor<8x8xf32>, tensor<f32>) -> tensor<f32>
    %cst_2 = stablehlo.constant dense<6.400000e+01> : tensor<f32>
    %12 = stablehlo.divide %11, %cst_2 : tensor<f32>
    %cst_3 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %cst_4 = stablehlo.constant dense<6.400000e+01> : tensor<f32>
    %13 = stablehlo.divide %cst_3, %cst_4 : tensor<f32>
    %14 = stablehlo.broadcast_in_dim %13, dims = [] : (tensor<f32>) -> tensor<8x8xf32>
    %15 = stablehlo.multiply %14, %10 : tensor<8x8xf32>
    %16 = stablehlo.multiply %15, %6 : tensor<8x8xf32>
    %17 = stablehlo.multiply %16, %4 : tensor<8x8xf32>
    %18 = stablehlo.add %16, %17 : tensor<8x8xf32>
    %cst_5 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %19 = stablehlo.reduce(%18 init: %cst_5) applies stablehlo.add across dimensions = [0] : (tensor<8x8xf32>, tensor<f32>) -> tensor<8xf32>
    %20 = stablehlo.reshape %19 : (tensor<8xf32>) -> tensor<1x8xf32>
    %cst_6 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %21 = stablehlo.reduce(%20 init: %cst_6) applies stablehlo.add across dimensions = [0] : (tensor<1x8xf32>, tensor<f32>) -> tensor<8xf32>
    %22 = stablehlo.dot_general %18, %arg0, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x8xf32>, tensor<8x32xf32>) -> tensor<8x32xf32>
    %23 = stablehlo.transpose %22, dims = [1, 0] : (tensor<8x32xf32>) -> tensor<32x8xf32>
    %24 = stablehlo.dot_general %18, %arg1, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<8x8xf32>, tensor<32x8xf32>) -> tensor<8x32xf32>
    return %12, %21, %23, %24 : tensor<f32>, tensor<8xf32>, tensor<32x8xf32>, tensor<8x32xf32>
  }
}
