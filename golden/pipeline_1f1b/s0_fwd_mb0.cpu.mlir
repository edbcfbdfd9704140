module @jit_s0_fwd_mb0 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<4x4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg1: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<4x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x16xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.slice %arg0 [0:1, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %1 = stablehlo.reshape %0 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %2 = stablehlo.dot_general %1, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT] : (tensor<4x8xf32>, tensor<8x16xf32>) -> tensor<4x16xf32>
    %3 = stablehlo.broadcast_in_dim %arg2, dims = [1] : (tensor<16xf32>) -> tensor<1x16xf32>
    %4 = stablehlo.broadcast_in_dim %3, dims = [0, 1] : (tensor<1x16xf32>) -> tensor<4x16xf32>
    %5 = stablehlo.add %2, %4 : tensor<4x16xf32>
    %6 = stablehlo.tanh %5 : tensor<4x16xf32>
    %cst = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<4x16xf32>
    %8 = stablehlo.subtract %7, %6 : tensor<4x16xf32>
    return %1, %6, %8 : tensor<4x8xf32>, tensor<4x16xf32>, tensor<4x16xf32>
  }
}
