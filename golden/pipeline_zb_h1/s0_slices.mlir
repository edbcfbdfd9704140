module @jit_s0_slices attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<4x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) {
    %0 = stablehlo.slice %arg0 [0:4, 0:8] : (tensor<16x8xf32>) -> tensor<4x8xf32>
    %1 = stablehlo.slice %arg0 [4:8, 0:8] : (tensor<16x8xf32>) -> tensor<4x8xf32>
    %2 = stablehlo.slice %arg0 [8:12, 0:8] : (tensor<16x8xf32>) -> tensor<4x8xf32>
    %3 = stablehlo.slice %arg0 [12:16, 0:8] : (tensor<16x8xf32>) -> tensor<4x8xf32>
    return %0, %1, %2, %3 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>
  }
}
