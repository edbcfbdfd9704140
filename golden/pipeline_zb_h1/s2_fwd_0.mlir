module @jit_s2_fwd_0 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<16x4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<16x4xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<4x4x4xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, tensor<i32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, []>}) {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x16x4xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x16x4xf32>) -> tensor<16x4xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<1x4xf32>
    %3 = stablehlo.reshape %2 : (tensor<1x4xf32>) -> tensor<4xf32>
    %4 = stablehlo.reshape %arg0 : (tensor<16x4xf32>) -> tensor<4x4x4xf32>
    %c = stablehlo.constant dense<0> : tensor<i32>
    return %1, %3, %4, %c : tensor<16x4xf32>, tensor<4xf32>, tensor<4x4x4xf32>, tensor<i32>
  }
}
