module @jit_s0_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<8x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<8x32xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<32xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<16x32xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<8x32xf32>
    %1 = stablehlo.multiply %0, %arg2 : tensor<8x32xf32>
    %2 = stablehlo.add %0, %1 : tensor<8x32xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %3 = stablehlo.reduce(%2 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<8x32xf32>, tensor<f32>) -> tensor<32xf32>
    %4 = stablehlo.reshape %3 : (tensor<32xf32>) -> tensor<1x32xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %cst_0) applies stablehlo.add across dimensions = [0] : (tensor<1x32xf32>, tensor<f32>) -> tensor<32xf32>
    %6 = stablehlo.dot_general %2, %arg3, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x32xf32>, tensor<8x16xf32>) -> tensor<32x16xf32>
    %7 = stablehlo.transpose %6, dims = [1, 0] : (tensor<32x16xf32>) -> tensor<16x32xf32>
    return %5, %7 : tensor<32xf32>, tensor<16x32xf32>
  }
}
