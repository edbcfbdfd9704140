module @jit_s1_wgrad_mb0 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<4x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<16x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.reduce(%arg0 init: %cst) applies stablehlo.add across dimensions = [0] : (tensor<4x16xf32>, tensor<f32>) -> tensor<16xf32>
    %1 = stablehlo.reshape %0 : (tensor<16xf32>) -> tensor<1x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %2 = stablehlo.reduce(%1 init: %cst_0) applies stablehlo.add across dimensions = [0] : (tensor<1x16xf32>, tensor<f32>) -> tensor<16xf32>
    %3 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<16x16xf32>
    %4 = stablehlo.transpose %3, dims = [1, 0] : (tensor<16x16xf32>) -> tensor<16x16xf32>
    %5 = stablehlo.add %arg2, %4 : tensor<16x16xf32>
    %6 = stablehlo.add %arg3, %2 : tensor<16xf32>
    return %5, %6 : tensor<16x16xf32>, tensor<16xf32>
  }
}
